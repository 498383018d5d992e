"""The training-loop layer, over the DCP adapter.

:mod:`~dcpstore.training.checkpointer` (the ``Checkpointer`` front) over its parts, one
job each: :mod:`~dcpstore.training.config`, :mod:`~dcpstore.training.context`,
:mod:`~dcpstore.training.collectives` (a coordinator's answer or failure on every rank),
:mod:`~dcpstore.training.root`, :mod:`~dcpstore.training.steps`,
:mod:`~dcpstore.training.saving`, :mod:`~dcpstore.training.writers`,
:mod:`~dcpstore.training.loading`, :mod:`~dcpstore.training.background`,
:mod:`~dcpstore.training.drain` and :mod:`~dcpstore.training.retention`. Beside it:
:mod:`~dcpstore.training.local_tier`, :mod:`~dcpstore.training.latest` (the verified
latest pointer), :mod:`~dcpstore.training.state` (``AppState``) and
:mod:`~dcpstore.training.weights` (weights-only loads, export).
"""

from dcpstore._compat import submodule_getattr

__getattr__ = submodule_getattr(__name__)
