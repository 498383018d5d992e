"""Tools over checkpoints: :mod:`~dcpstore.tools.ops` (ls, inspect, verify, cp, rm, gc,
export), the :mod:`~dcpstore.tools.cli` and the :mod:`~dcpstore.tools.demo`."""

from dcpstore._compat import submodule_getattr

__getattr__ = submodule_getattr(__name__)
