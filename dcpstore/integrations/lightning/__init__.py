"""PyTorch Lightning: sharded FSDP2 checkpoints on any dcpstore URI.

Lightning 2.6's ``ModelParallelStrategy`` saves with ``dcp.save(checkpoint_id=Path(dir))``
and ``torch.save(meta, Path(dir) / "meta.pt")``; ``Path`` turns ``s3://b/x`` into ``s3:/b/x``
and the checkpoint lands in a local directory named ``s3:``. The user's change here is one
object, the strategy:

>>> from dcpstore.integrations.lightning import DcpstoreModelParallelStrategy
>>> strategy = DcpstoreModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
>>> trainer = Trainer(strategy=strategy, default_root_dir="s3://bucket/run7",
...                   callbacks=[ModelCheckpoint(save_top_k=2, monitor="loss", save_last=True)])
>>> trainer.fit(model, ckpt_path="last")

What it does:

- **Save.** Every rank streams its model and optimizer shards through dcpstore's writer;
  Lightning's other state (loops, callbacks, hyper-parameters: stock Lightning's
  ``meta.pt``) is ``torch.save``-d by rank 0, broadcast, and stored in the same DCP
  checkpoint as the uint8 tensor :data:`META_KEY`. ``.metadata`` is the one commit point,
  so a checkpoint is never torn, and overwriting one (same file name) is atomic.
- **"last" is a pointer.** ``ModelCheckpoint(save_last=True)`` does not write a second full
  copy: ``last.ckpt`` is a small JSON object naming the checkpoint just committed at the
  same step (a full copy goes to a hidden ``.dcpstore-last-*`` checkpoint only when no
  checkpoint was saved at that step). The pointer is written only after its target
  committed, with one single-request PUT, so it never names an uncommitted checkpoint.
- **Retention.** ``save_top_k`` deletes through dcpstore (``.metadata`` first), the
  checkpoint a run resumed from included once it is loaded; never one a "last" pointer
  (this run's or an earlier run's) names: that one is deleted when "last" moves on, or
  when ``fit`` ends. With ``async_save=True``, only after the newer save committed.
- **Async.** ``async_save=True`` snapshots the state (a copy in CPU memory) and streams it
  with ``dcp.async_save`` on a dedicated gloo group while training goes on; the next save
  (or the end of ``fit``) waits for it, and a failed background save is raised there.
- **Paths.** Importing this module points Lightning's ``get_filesystem`` at
  :class:`DcpstoreFileSystem` for every remote scheme dcpstore serves (``s3``, ``gs``,
  ``msc``, ...), so ``ModelCheckpoint``'s ``ls``/``exists``/``rm``/``modified`` and
  ``CSVLogger`` go through dcpstore and need no s3fs. fsspec's own registry is untouched.
  A URI that was mangled on the way (``s3:/b/x``, a ``Path("s3://...")``, a local
  directory named ``s3:``) is refused.
- **Other strategies.** Importing this module also makes ``Trainer.fit`` (``validate``,
  ``test``, ``predict``, ``save_checkpoint``) refuse a dcpstore URI with
  :class:`~dcpstore.errors.ConfigurationError` unless the strategy is
  :class:`DcpstoreModelParallelStrategy` (``FSDPStrategy`` would write into ``./s3:``).

The modules: :mod:`~dcpstore.integrations.lightning.strategy` (the strategy: save, load,
async saves), :mod:`~dcpstore.integrations.lightning.retention` ("last" pointers and
deletion on the store), :mod:`~dcpstore.integrations.lightning.filesystem` (Lightning's
paths) and :mod:`~dcpstore.integrations.lightning.uris` (mangled URIs refused).
"""

from __future__ import annotations

# the names the submodules import, checked first: without them, say what to install
try:
    from fsspec.spec import AbstractFileSystem  # noqa: F401
    from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: F401
    from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: F401
    from lightning.pytorch.strategies.launchers.launcher import _Launcher  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "dcpstore.integrations.lightning needs PyTorch Lightning 2.6: "
        "pip install 'lightning>=2.6,<2.7'"
    ) from exc

from dcpstore.integrations.lightning.filesystem import (
    DcpstoreFileSystem,
    patch_lightning_filesystem,
)
from dcpstore.integrations.lightning.retention import LAST_COPY_PREFIX as LAST_COPY_PREFIX
from dcpstore.integrations.lightning.retention import POINTER_FORMAT as POINTER_FORMAT
from dcpstore.integrations.lightning.strategy import META_KEY, DcpstoreModelParallelStrategy
from dcpstore.integrations.lightning.uris import checked_uri as checked_uri

__all__ = [
    "META_KEY",
    "DcpstoreFileSystem",
    "DcpstoreModelParallelStrategy",
    "patch_lightning_filesystem",
]
