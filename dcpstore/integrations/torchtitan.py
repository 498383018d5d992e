"""torchtitan: sharded checkpoints on ``s3://``, ``gs://``, ``msc://`` or local disk via dcpstore.

The one change is the checkpoint config's class: in a torchtitan config function,
keeping what the model's config function set (``last_save_model_only``, ``interval``...),

>>> from dcpstore.integrations.torchtitan import DcpstoreCheckpointManager
>>> config.checkpoint = DcpstoreCheckpointManager.Config.from_config(
...     config.checkpoint, enable=True, folder="s3://bucket/run7", keep_latest_k=3)

:class:`DcpstoreCheckpointManager` is torchtitan's own DCP ``CheckpointManager`` (same
config fields, ``step-N`` layout, async modes, HF export) with its storage calls made
through dcpstore's public API:

- saves pass ``storage_writer=dcpstore.get_writer(step_uri)`` to ``dcp.save`` /
  ``dcp.async_save`` (all three ``async_mode`` values); loads pass
  ``dcpstore.get_reader(step_uri)``;
- the latest step is found with one listing on rank 0 (broadcast to the others), and only
  a step whose ``.metadata`` exists counts: dcpstore writes it last, so a save that did not
  finish is never named;
- ``keep_latest_k`` counts committed steps only, deletes ``.metadata`` first, and deletes
  through dcpstore (no ``shutil.rmtree``, no fsspec);
- a folder such as ``s3:/bucket/x`` (a URI that lost a slash) is refused.

Backend options come from the environment (``DCPSTORE_S3_ENDPOINT_URL`` and friends; see
the backend pages) and each cloud's own credential chain. Importing this module imports
torchtitan (``torchtitan.components.checkpointer``) and nothing else of it.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import queue
import re
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torchtitan.components.checkpointer import dcp as _titan_dcp
from torchtitan.components.checkpointer.base import MODEL, BaseCheckpointManager, purge_thread
from torchtitan.components.checkpointer.dcp import AsyncMode, CheckpointManager
from torchtitan.tools.utils import GarbageCollection

from dcpstore.dcp.api import get_reader, get_writer, open_backend
from dcpstore.errors import BackendNotFoundError, CheckpointNotFoundError
from dcpstore.integrations.dcp_routing import check_uri, serves

__all__ = ["DcpstoreCheckpointManager", "committed_steps", "remove_step"]

logger = logging.getLogger(__name__)

_STEP = re.compile(r"^step-(\d+)$")
_METADATA = ".metadata"
_HF_INDEX = "model.safetensors.index.json"
_fs_lock = threading.Lock()


def _join(folder: str, name: str) -> str:
    return f"{folder.rstrip('/')}/{name}"


def _scan(folder: str) -> tuple[list[int], list[int]]:
    """(committed, all) step numbers under ``folder``, from one listing."""
    backend = open_backend(folder)
    try:
        committed: set[int] = set()
        seen: set[int] = set()
        for obj in backend.list():
            head, _, rest = obj.key.partition("/")
            match = _STEP.match(head)
            if not match:
                continue
            step = int(match.group(1))
            seen.add(step)
            if rest in (_METADATA, _HF_INDEX):
                committed.add(step)
        return sorted(committed), sorted(seen)
    finally:
        backend.close()


def committed_steps(folder: str) -> list[int]:
    """Steps under ``folder`` (``step-N/``) whose checkpoint is committed, ascending.

    A dcpstore save writes ``step-N/.metadata`` last, after every rank's data and the
    manifest, so a step listed here is complete. One listing of ``folder``.
    """
    return _scan(folder)[0]


def remove_step(uri: str) -> None:
    """Delete the checkpoint at ``uri`` through dcpstore, ``.metadata`` first.

    Deleting the commit marker first means a reader never sees a half-deleted checkpoint
    as complete. A missing checkpoint is not an error (retention may race a manual ``rm``).
    """
    backend = open_backend(uri)
    try:
        keys = [o.key for o in backend.list()]
        if _METADATA in keys:
            backend.delete([_METADATA])
        rest = [k for k in keys if k != _METADATA]
        if rest:
            backend.delete(rest)
        backend.remove_empty_dirs()
    except (FileNotFoundError, CheckpointNotFoundError):
        pass
    finally:
        backend.close()


class _StoreFilesystem:
    """torchtitan's ``tools.filesystem`` functions, with URIs dcpstore serves handled by it.

    Swapped in for ``torchtitan.components.checkpointer.dcp.filesystem`` only while
    :meth:`DcpstoreCheckpointManager._load` runs; local paths keep torchtitan's own code.
    """

    def __init__(self, original: Any) -> None:
        self._original = original
        self.join = original.join
        self.is_remote = original.is_remote

    def _ours(self, path: Any) -> bool:
        return isinstance(path, str) and "://" in path and serves(path)

    def _keys(self, path: str) -> list[str]:
        backend = open_backend(path)
        try:
            return [o.key for o in backend.list()]
        finally:
            backend.close()

    def exists(self, path: Any) -> bool:
        return bool(self._keys(path)) if self._ours(path) else bool(self._original.exists(path))

    isdir = exists

    def isfile(self, path: Any) -> bool:
        if not self._ours(path):
            return bool(self._original.isfile(path))
        parent, _, name = path.rstrip("/").rpartition("/")
        return name in self._keys(parent)

    def listdir(self, path: Any) -> list[str]:
        if not self._ours(path):
            return list(self._original.listdir(path))
        return sorted({key.partition("/")[0] for key in self._keys(path)})

    def rmtree(self, path: Any) -> None:
        if self._ours(path):
            remove_step(path)
        else:
            self._original.rmtree(path)


@contextmanager
def _store_filesystem() -> Iterator[None]:
    with _fs_lock:
        original = _titan_dcp.filesystem
        _titan_dcp.filesystem = _StoreFilesystem(original)
        try:
            yield
        finally:
            _titan_dcp.filesystem = original


class DcpstoreCheckpointManager(CheckpointManager):
    """torchtitan's DCP ``CheckpointManager``, storing through dcpstore.

    Select it with ``config.checkpoint = DcpstoreCheckpointManager.Config.from_config(
    config.checkpoint, enable=True, folder=...)``, which keeps the fields the model's
    config function set (or with ``DcpstoreCheckpointManager.Config(...)``, which starts
    from torchtitan's defaults); the fields are those of torchtitan's
    ``CheckpointManager.Config``. ``folder`` may be a local path or any URI dcpstore
    serves (``s3://``, ``gs://``, ``msc://``, ``file://``, plugin schemes).

    Raises:
        dcpstore.InvalidURIError: ``folder`` is a mangled URI (``s3:/b/x``).
        dcpstore.BackendNotFoundError: No dcpstore backend serves ``folder``'s scheme.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        """torchtitan's ``CheckpointManager.Config``; building it makes a dcpstore manager."""

        @classmethod
        def from_config(cls, config: BaseCheckpointManager.Config,
                        **changes: Any) -> DcpstoreCheckpointManager.Config:
            """``config``'s settings in dcpstore's config class, with ``changes`` applied.

            Use it on the config a model's config function made, so that what it set
            (``last_save_model_only=False``, ``interval``, ``keep_latest_k``...) is kept;
            building a fresh ``Config(...)`` instead starts from torchtitan's defaults
            (``last_save_model_only=True``: the last step is saved model-only, and a
            resumed run then fails with ``Missing key in checkpoint state_dict``)::

                config.checkpoint = DcpstoreCheckpointManager.Config.from_config(
                    config.checkpoint, enable=True, folder="s3://bucket/run7")

            Args:
                config: The checkpoint config to start from: torchtitan's
                    ``CheckpointManager.Config`` (or any ``BaseCheckpointManager.Config``).
                **changes: Fields to set on top (``enable``, ``folder``, ``interval``...).

            Returns:
                A new config (nothing is shared with ``config``), validated as
                torchtitan validates its own.

            Raises:
                TypeError: ``config`` has fields this config lacks (they would be
                    dropped), or ``changes`` names a field it lacks.
                ValueError: The resulting settings are invalid (torchtitan's checks).
            """
            ours = {f.name for f in dataclasses.fields(cls) if f.init}
            theirs = {f.name for f in dataclasses.fields(config) if f.init}
            lost = sorted(theirs - ours - changes.keys())
            if lost:
                raise TypeError(
                    f"{type(config).__qualname__} has fields that "
                    f"DcpstoreCheckpointManager.Config lacks: {', '.join(lost)}; they would "
                    "be dropped (dcpstore's manager is torchtitan's DCP CheckpointManager)")
            unknown = sorted(changes.keys() - ours)
            if unknown:
                raise TypeError(
                    f"DcpstoreCheckpointManager.Config has no field {', '.join(unknown)}")
            values = {name: copy.deepcopy(getattr(config, name)) for name in theirs & ours}
            return cls(**{**values, **changes})

    def __init__(self, config: Config, **kwargs: Any) -> None:
        # torchtitan's retention thread deletes with shutil/fsspec: it is never started
        # (keep_latest_k=0 for the base class), and dcpstore's starts in its place
        base = copy.copy(config)  # not dataclasses.replace: no second round of its checks
        base.keep_latest_k = 0
        super().__init__(base, **kwargs)
        if not self.enable:
            return
        check_uri(self.folder)
        if not serves(self.folder):
            open_backend(self.folder)  # raises the backend's own "install X" error
            raise BackendNotFoundError(f"no dcpstore backend serves {self.folder!r}")
        self.keep_latest_k = config.keep_latest_k
        if self.keep_latest_k > 0:
            self.purge_queue: queue.Queue[str | None] = queue.Queue()
            self.purge_thread = threading.Thread(
                target=purge_thread, args=(self.purge_queue, remove_step), daemon=True,
                name="dcpstore-purge",
            )
            self.purge_thread.start()

    # -- storage: writer and reader ------------------------------------------------------

    @torch.no_grad()
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Any:
        """Save ``state_dict`` to ``checkpoint_id`` with a dcpstore writer.

        HF safetensors export (``to_hf``, local folders only in torchtitan) keeps
        torchtitan's own writer.
        """
        if to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode,
                                    enable_garbage_collection, to_hf)
        writer = get_writer(checkpoint_id, overwrite=True)
        ret: Future[Any] | Any | None
        if async_mode == AsyncMode.ASYNC:
            ret = dcp.async_save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id,
                                 process_group=self.pg)
        elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            ret = dcp.async_save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id,
                                 process_group=self.pg,
                                 async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                                 async_stager=self.stager)
        else:
            ret = dcp.save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    def dcp_load(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        from_hf: bool,
        from_quantized: bool,
    ) -> None:
        """Load ``checkpoint_id`` into ``state_dict`` with a dcpstore reader (any world size)."""
        if from_hf:
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        dcp.load(state_dict, storage_reader=get_reader(checkpoint_id),
                 checkpoint_id=checkpoint_id)
        if MODEL in self.states:  # the model's entries were flattened into state_dict
            self.states[MODEL].load_state_dict(state_dict)

    # -- discovery and retention ---------------------------------------------------------

    def _load(self, step: int = -1) -> bool:
        with _store_filesystem():
            return bool(super()._load(step))

    def _find_load_step(self, folder: str = "") -> int:
        """The newest committed step under ``folder``, or -1; listed on rank 0 only."""
        folder = folder or self.folder
        found = [-1]
        if not dist.is_initialized() or dist.get_rank() == 0:
            steps = committed_steps(folder)
            found = [steps[-1] if steps else -1]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(found, src=0, group=self.pg)
        return int(found[0])

    def _purge_stale_checkpoints(self) -> None:
        """Queue for deletion all but the newest ``keep_latest_k`` committed steps.

        Steps still being written (no ``.metadata`` yet) never count towards the k and are
        never deleted unless they are older than every kept step (a crashed save).
        """
        if self.keep_latest_k <= 0 or dist.get_rank() != 0:
            return
        committed, seen = _scan(self.folder)
        keep = committed[-self.keep_latest_k:]
        if not keep:
            return
        oldest_kept = keep[0]
        for step in seen:
            if step < oldest_kept:
                self.purge_queue.put(_join(self.folder, f"step-{step}"))
