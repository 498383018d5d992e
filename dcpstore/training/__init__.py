"""The training-loop layer, over the DCP adapter.

:mod:`~dcpstore.training.checkpointer` (steps, async saves, retention, the local tier's
drain), :mod:`~dcpstore.dcp.staging` (snapshots at ``save()``),
:mod:`~dcpstore.training.local_tier`, :mod:`~dcpstore.training.latest` (the verified
latest pointer), :mod:`~dcpstore.training.state` (``AppState``) and
:mod:`~dcpstore.training.weights` (weights-only loads, export).
"""

from dcpstore._compat import submodule_getattr

__getattr__ = submodule_getattr(__name__)
