"""The generic DCP ``StorageWriter`` over any backend.

DCP calls, in this order (``dcp.save`` / ``dcp.async_save``)::

    reset(checkpoint_id)              every rank; a new save
    storage_meta()                    every rank
    set_up_storage_writer(...)        every rank
    prepare_local_plan(plan)          every rank: summarize plain-tensor shapes
    prepare_global_plan(plans)        coordinator: overwrite check, sharding guard,
                                      assign the save id to every rank's plan
    write_data(plan, planner)         every rank: stream data files, CRC32C as they go
    finish(metadata, results)         coordinator, only if every rank succeeded:
                                      manifest, then .metadata (the commit point),
                                      then delete files the overwritten save used

Nothing is committed unless every rank's writes succeeded; a rank whose write fails
aborts its own uploads, and :meth:`Writer.discard` (called by :func:`dcpstore.save`)
removes what the other ranks wrote. See ``docs/`` for the full commit protocol.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from dcpstore import errors
from dcpstore._version import __version__
from dcpstore.dcp import layout
from dcpstore.dcp.bound import BoundToBackend
from dcpstore.dcp.checksum import crc32c
from dcpstore.dcp.commit import (
    Target,
    _check_target,
    _commit,
    _commit_landed,
    _delete_quietly,
    _delete_stale,
    _remove_save,
)
from dcpstore.dcp.data_file import PAYLOAD_BLOCK, _write_data_file, _WrittenItem
from dcpstore.dcp.dist import UNSET
from dcpstore.dcp.guard import check_global_plan, summarize_local_plan
from dcpstore.dcp.incremental import (
    _Base,
    _BaseItem,
    _check_referenced,
    _ChunkKey,
    _close_base,
    _frozen_keys,
    _open_base,
    payload_digest,
)
from dcpstore.dcp.manifest import FileRecord, Manifest
from dcpstore.dcp.packing import _file_bytes, _layout
from dcpstore.dcp.save_plan import (
    _Assignment,
    _assignment_of,
    _global_plans,
    _guard_input,
    _take_pending_save_id,
)
from dcpstore.storage.backend import Backend
from dcpstore.storage.options import WriterOptions
from dcpstore.torch_internals import StorageInfo, portable_metadata_bytes

__all__ = ["Writer", "WriterOptions", "payload_digest"]

logger = logging.getLogger(__name__)

_DCP_VERSION = "1.0.0"

#: ``Writer`` works with torch's save-plan caching
#: (``DefaultSavePlanner(enable_plan_caching=True)``).
SUPPORTS_PLAN_CACHING = True


class Writer(BoundToBackend, StorageWriter):
    """DCP storage writer over a :class:`~dcpstore.Backend`. Create with
    :func:`dcpstore.get_writer`; pass as ``storage_writer=`` to ``dcp.save``.

    Args:
        backend: Where the checkpoint goes.
        options: Writer options.
        extensions: DCP stream transforms (e.g. ``[ZStandard()]``), recorded per item so
            torch's readers can decode them.
        rebind: Function turning a ``checkpoint_id`` passed to ``dcp.save`` into a
            backend with the same options (set by :func:`dcpstore.get_writer`).
        process_group: The group of the ``dcp.save`` this writer serves (``None``: the
            world): the rank that names its files when DCP passes none.
    """

    _bound_as = "this Writer saves to"

    def __init__(self, backend: Backend, options: WriterOptions | None = None, *,
                 extensions: Sequence[Any] | None = None, rebind: Any = None,
                 process_group: Any = UNSET) -> None:
        super().__init__(backend, rebind)
        self.process_group = process_group
        self.options = options or WriterOptions()
        if self.options.files_per_rank is not None and self.options.files_per_rank < 1:
            raise ValueError(f"files_per_rank must be >= 1 or None (automatic), got "
                             f"{self.options.files_per_rank}")
        self.extensions = list(extensions) if extensions else []
        self.is_coordinator = True
        self.rank = 0
        self.save_id = layout.new_save_id()
        self._target = Target()  # what the coordinator found at the URI
        # the .metadata this save sent, once its PUT was attempted (see discard)
        self._commit_bytes: bytes | None = None
        self._frozen = _frozen_keys(self.options.frozen)
        self._base: _Base | None = None  # coordinator, incremental saves
        #: Bytes of data files the last committed save wrote (coordinator).
        self.bytes_written = 0
        #: Bytes of items the last committed save referenced in sibling steps instead
        #: of writing them again (coordinator).
        self.bytes_referenced = 0

    def __repr__(self) -> str:
        return f"Writer({self.backend.uri!r}, overwrite={self.options.overwrite})"

    @property
    def commit_size(self) -> int | None:
        """Size in bytes of the ``.metadata`` this save sent (coordinator; ``None`` until
        its PUT was attempted)."""
        return None if self._commit_bytes is None else len(self._commit_bytes)

    # -- DCP protocol ------------------------------------------------------------------

    def reset(self, checkpoint_id: Any = None) -> None:
        """Start a new save, optionally at another location (same backend options)."""
        self._move_to(checkpoint_id)
        self.save_id = layout.new_save_id()
        self._target = Target()
        self._commit_bytes = None
        self._release_base()

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.backend.uri, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        _take_pending_save_id()  # nothing left over from an earlier save on this thread
        rank = kwargs.get("rank")
        if rank is None and dist.is_available() and dist.is_initialized():
            group = None if self.process_group is UNSET else self.process_group
            rank = dist.get_rank(group)
        if rank is None or rank < 0:  # -1: this process is not in the given group
            rank = 0
        self.rank = int(rank)
        if kwargs.get("use_collectives", True) is False:
            raise errors.DcpstoreError(
                "dcpstore needs a coordinated save (use_collectives=True): without one no "
                "rank can know that every rank finished, so nothing could be committed "
                "atomically"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return dataclasses.replace(plan, storage_data=summarize_local_plan(plan, self.rank))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: check the target once, run the sharding guard, and give every
        rank this save's id.

        With torch's plan caching, a rank whose global plan is unchanged gets
        ``SavePlan([], usable=False)`` and writes the plan it cached: that empty plan
        carries this save's fresh id. The guard is skipped when no local plan changed
        and checks every rank's plan as soon as one did (see :func:`_guard_input`).
        """
        if self.options.sharding_guard:
            summaries = _guard_input(plans)
            if summaries is not None:
                check_global_plan(summaries)
        self._target = _check_target(self.backend, self.options.overwrite)
        self._release_base()
        if self.options.base:
            if not all(p.usable for p in plans):
                raise errors.DcpstoreError(
                    f"{self.backend.uri}: an incremental save (base={self.options.base}) "
                    "cannot reuse a cached save plan: which bytes are references changes "
                    "with every base. Use a planner without enable_plan_caching for "
                    "incremental saves"
                )
            self._base = _open_base(self.backend, self.options.base, save_id=self.save_id,
                                    base_required=self.options.base_required,
                                    rebind=self._rebind)
        known = self._base.items if self._base is not None else {}
        return _global_plans(plans, save_id=self.save_id, rank=self.rank, known=known)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        assignment = self._assignment(plan)
        self.save_id = assignment.save_id
        base = assignment.base
        buckets, threads, window = _layout(self.backend, plan.items,
                                           self.options.files_per_rank, self.rank)
        names = [layout.data_file_name(assignment.rank, i, self.save_id)
                 for i in range(len(buckets))]

        def write(name: str, items: list[WriteItem]) -> list[WriteResult]:
            if window is None:
                return self._write_file(name, items, planner, base)
            hint = _file_bytes(items)
            with window.hold(self.backend.upload_memory(hint)):
                return self._write_file(name, items, planner, base, size_hint=hint)

        results: list[WriteResult] = []
        if len(buckets) <= 1 or threads <= 1:
            for name, bucket in zip(names, buckets, strict=True):
                results += write(name, bucket)
        else:
            with ThreadPoolExecutor(threads, thread_name_prefix="dcpstore-file") as pool:
                futures = [pool.submit(write, n, b) for n, b in zip(names, buckets, strict=True)]
                failures = []
                for pending in futures:
                    try:
                        results += pending.result()
                    except BaseException as exc:
                        failures.append(exc)
                if failures:
                    raise failures[0]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage_data: dict[Any, StorageInfo] = {}
        files: dict[str, FileRecord] = {}
        references: dict[str, FileRecord] = {}
        referenced = 0
        for rank_results in results:
            for wr in rank_results:
                item = cast(_WrittenItem, wr.storage_data)
                storage_data[wr.index] = StorageInfo(
                    item.relative_path, item.offset, item.length,
                    transform_descriptors=item.transform_descriptors,
                )
                if item.reference:
                    if self._base is None or item.relative_path not in self._base.records:
                        raise errors.DcpstoreError(f"rank results reference {item.relative_path}, "
                                                   "which is not a file of this save's base")
                    references[item.relative_path] = self._base.records[item.relative_path]
                    referenced += item.length
                if item.file is not None:
                    files[item.relative_path] = item.file
        if references:
            assert self._base is not None
            _check_referenced(self._base, references)
        metadata.storage_data = storage_data
        metadata.version = _DCP_VERSION
        metadata.storage_meta = StorageMeta(checkpoint_id=self.backend.uri, save_id=self.save_id)
        metadata_bytes = portable_metadata_bytes(metadata)
        manifest = Manifest(
            save_id=self.save_id,
            world_size=len(results),
            files=files,
            dcpstore_version=__version__,
            torch_version=torch.__version__,
            extra={"extensions": [type(e).__name__ for e in self.extensions]},
            # .metadata is covered too: a damaged chunk offset there loads wrong values
            metadata=FileRecord(len(metadata_bytes), crc32c(metadata_bytes)),
            payload_block=PAYLOAD_BLOCK,
            references=references,
        )
        manifest_key = layout.manifest_key(self.save_id)
        try:
            self.backend.put(manifest_key, manifest.to_bytes())
            self._commit_bytes = metadata_bytes
            replaced = _commit(self.backend, metadata_bytes, self._target,
                               overwrite=self.options.overwrite)
        except BaseException as exc:
            # A PUT whose answer was lost may still have landed: then .metadata names
            # this save's files, and deleting them would destroy the checkpoint.
            landed = (_commit_landed(self.backend, self._commit_bytes)
                      if isinstance(exc, Exception) else None)
            if not landed:
                if landed is None:
                    logger.error("commit of %s failed and whether .metadata was replaced "
                                 "cannot be told; keeping this save's files",
                                 self.backend.uri)
                else:
                    logger.error("commit of %s failed; removing this save's files",
                                 self.backend.uri)
                    _delete_quietly(self.backend, [*files, manifest_key])
                    self._release_base()
                raise
            logger.warning("commit of %s: the .metadata request failed (%s), but the store "
                           "holds this save's .metadata: committed", self.backend.uri, exc)
            replaced = self._target
        self.bytes_written = manifest.total_bytes
        self.bytes_referenced = referenced
        logger.info(
            "committed %s (save %s, %d files, %.1f MB written, %.1f MB referenced)",
            self.backend.uri, self.save_id, len(files), manifest.total_bytes / 1e6,
            referenced / 1e6,
        )
        self._release_base()  # committed: the new step's references now protect them
        _delete_stale(self.backend, replaced.previous, set(files))

    # -- failure handling ----------------------------------------------------------------

    def discard(self) -> bool | None:
        """Delete every object of this save (after a failed save, on the coordinator).

        Never touches ``.metadata`` or files of other saves, nor the files of this save
        when its ``.metadata`` may have landed after all.

        Returns:
            ``False`` when nothing of this save was committed (its files are removed),
            ``True`` when its ``.metadata`` did land (the save is committed and kept),
            ``None`` when that cannot be told (kept; ``dcpstore verify`` tells).
        """
        landed = _commit_landed(self.backend, self._commit_bytes)
        if landed is not False:
            logger.warning("not removing the files of save %s at %s: its .metadata %s "
                           "committed", self.save_id, self.backend.uri,
                           "is" if landed else "may be")
            if landed:
                self._release_base()
            return landed
        self._release_base()
        _remove_save(self.backend, self.save_id)
        return False

    # -- internals ---------------------------------------------------------------------

    def _assignment(self, plan: SavePlan) -> _Assignment:
        """This rank's assignment for this save (see :func:`_assignment_of`)."""
        return _assignment_of(plan)

    def _write_file(
        self, name: str, items: Sequence[WriteItem], planner: SavePlanner,
        base: dict[_ChunkKey, _BaseItem] | None = None, size_hint: int | None = None,
    ) -> list[WriteResult]:
        """Write one data file of this rank (see :func:`_write_data_file`)."""
        return _write_data_file(self.backend, name, items, planner,
                                extensions=self.extensions, frozen=self._frozen,
                                content_hash=self.options.content_hash, base=base,
                                size_hint=size_hint)

    def _release_base(self) -> None:
        """Remove this save's pin and forget its base."""
        base, self._base = self._base, None
        _close_base(base)
