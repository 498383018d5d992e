"""Tools over checkpoints: :mod:`~dcpstore.tools.ops` (the operations, from
:mod:`~dcpstore.tools.listing` (ls, inspect), :mod:`~dcpstore.tools.verify` and
:mod:`~dcpstore.tools.maintenance` (cp, rm, gc)), the :mod:`~dcpstore.tools.cli` and the
:mod:`~dcpstore.tools.demo`."""

from dcpstore._compat import submodule_getattr

__getattr__ = submodule_getattr(__name__)
