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

import contextlib
import dataclasses
import io
import logging
import math
import pickle
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StorageWriterTransforms
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future
from typing_extensions import Buffer

from dcpstore import errors
from dcpstore._version import __version__
from dcpstore.dcp import layout
from dcpstore.dcp import references as refs
from dcpstore.dcp.bound import BoundToBackend
from dcpstore.dcp.checksum import crc32c, crc32c_combine
from dcpstore.dcp.codec import encode_tensor
from dcpstore.dcp.guard import LocalPlanSummary, check_global_plan, summarize_local_plan
from dcpstore.dcp.manifest import FileRecord, Manifest, Payload
from dcpstore.dcp.metadata_io import load_metadata, read_manifest
from dcpstore.dcp.read_plan import chunk_index
from dcpstore.dcp.safe_pickle import safe_loads
from dcpstore.storage.backend import Backend, Upload
from dcpstore.storage.options import AUTO_MAX_FILES, WriterOptions
from dcpstore.storage.resolve import open_backend
from dcpstore.storage.uri import validate_reference

__all__ = ["Writer", "WriterOptions", "payload_digest"]

logger = logging.getLogger(__name__)

_DCP_VERSION = "1.0.0"
# Tensors at least this large get their payload position recorded in the manifest, so
# readers can fetch their bytes straight into the destination.
_MIN_PAYLOAD = 4096
#: Payloads get a CRC32C per block of this many bytes: a reshard load that needs part of
#: a tensor reads and verifies whole blocks around it, not the whole item.
PAYLOAD_BLOCK = 1024 * 1024
# Writes at least this large are checksummed once and combined into the item and file
# CRCs; smaller ones (archive headers) are cheaper to checksum twice than to combine.
_COMBINE_MIN = 64 * 1024


#: ``Writer`` works with torch's save-plan caching
#: (``DefaultSavePlanner(enable_plan_caching=True)``).
SUPPORTS_PLAN_CACHING = True


@dataclass(frozen=True)
class _BaseItem:
    """A tensor chunk of the base checkpoint an incremental save may reference."""

    path: str  # relative_path from the new checkpoint (into the step holding the bytes)
    offset: int
    length: int
    crc32c: int
    payload: Payload
    dtype: torch.dtype
    sizes: tuple[int, ...]


#: ``(fqn, chunk offsets)`` of a tensor chunk.
_ChunkKey = tuple[str, tuple[int, ...]]


@dataclass
class _Assignment:
    """What the coordinator sends each rank in its global plan."""

    rank: int
    save_id: str
    #: Chunks of this rank's plan that the base holds (incremental saves).
    base: dict[_ChunkKey, _BaseItem] = dataclasses.field(default_factory=dict)


@dataclass
class _Base:
    """The coordinator's view of the base of an incremental save."""

    root: Backend  # the run root
    name: str  # this checkpoint's directory in it
    save_id: str  # the save that pinned it
    items: dict[_ChunkKey, _BaseItem]
    records: dict[str, FileRecord]  # by reference path


class _FreshSaveId:
    """The save id of this save, sent in the (otherwise empty) global plan of a save
    whose plan torch took from its plan cache.

    On a cache hit DCP still scatters the coordinator's global plan, but each rank then
    writes the plan it cached (with the save id of the save that filled the cache).
    Unpickling this object on the receiving rank notes the fresh id for the thread that
    runs the save; :meth:`Writer.write_data` replaces the cached plan's id with it.
    """

    def __init__(self, save_id: str) -> None:
        self.save_id = save_id

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return _received_save_id, (self.save_id,)

    def __repr__(self) -> str:
        return f"_FreshSaveId({self.save_id!r})"


_pending = threading.local()


def _received_save_id(save_id: str) -> _FreshSaveId:
    """Unpickling hook of :class:`_FreshSaveId`: note ``save_id`` for this thread."""
    _pending.save_id = save_id
    return _FreshSaveId(save_id)


def _take_pending_save_id() -> str | None:
    save_id: str | None = getattr(_pending, "save_id", None)
    _pending.save_id = None
    return save_id


def _summary(plan: SavePlan, rank: int) -> LocalPlanSummary:
    data = plan.storage_data
    return data if isinstance(data, LocalPlanSummary) else LocalPlanSummary(rank)


def _guard_input(plans: Sequence[SavePlan]) -> dict[int, LocalPlanSummary] | None:
    """Every rank's local-plan summary for the sharding guard; ``None`` when torch's
    plan cache found no local plan changed (those plans passed the guard when cached:
    torch caches a rank's local plan only once the global plan was accepted).

    With some plans changed, torch hands the storage writer only the global plans that
    changed, so a rank whose change was deduplicated away (a plain tensor saved by
    another rank: what the guard is for) arrives as an empty plan. The summaries of
    every rank are then those of the local plans torch merged for this save.
    """
    if all(p.usable for p in plans):
        return {i: _summary(p, i) for i, p in enumerate(plans)}
    if not any(p.usable for p in plans):
        return None
    changed = [i for i, p in enumerate(plans) if p.usable]
    cache = getattr(SavePlanner, "_cached_all_plans", None)
    for merged in (cache or {}).values():
        if len(merged) == len(plans) and all(
                merged[i].storage_data is plans[i].storage_data
                or merged[i].storage_data == plans[i].storage_data for i in changed):
            return {i: _summary(p, i) for i, p in enumerate(merged)}
    logger.warning("torch's merged local plans were not found; the sharding guard checks "
                   "only the %d changed plans", len(changed))
    return {i: _summary(plans[i], i) for i in changed}


@dataclass
class _WrittenItem:
    """``WriteResult.storage_data`` on its way to the coordinator."""

    relative_path: str
    offset: int
    length: int
    transform_descriptors: Sequence[str] | None
    crc32c: int
    file: FileRecord | None = None  # set on the last item of each file
    reference: bool = False  # bytes of a sibling step (an incremental save)


class _ChecksumStream(io.RawIOBase):
    """Write-only stream into an :class:`Upload` that tracks position and CRC32C (of the
    file and of the current item; one pass over every large write)."""

    def __init__(self, upload: Upload) -> None:
        self.upload = upload
        self.position = 0
        self.file_crc = 0
        self.item_crc = 0
        # writes of exactly ``_payload_size`` bytes (a tensor's storage): where each began
        # and the CRC32C of each PAYLOAD_BLOCK of it
        self._payload_size = 0
        self.payload_at: list[tuple[int, tuple[int, ...]]] = []
        self._want_digest = False
        self.payload_digest = ""

    def expect_payload(self, nbytes: int, *, digest: bool = False) -> None:
        """Note position and block CRCs of writes of ``nbytes`` bytes until the next call
        (and, with ``digest``, their XXH3-128 in :attr:`payload_digest`)."""
        self._payload_size = nbytes
        self.payload_at = []
        self._want_digest = digest
        self.payload_digest = ""

    def writable(self) -> bool:
        return True

    def write(self, data: Buffer) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        self.upload.write(view)
        if size and size == self._payload_size:
            blocks = []
            crc = 0
            # the content hash in the same pass, block by block, while each is in cache
            hasher = xxhash.xxh3_128() if self._want_digest else None
            for lo in range(0, size, PAYLOAD_BLOCK):
                block = view[lo : lo + PAYLOAD_BLOCK]
                blocks.append(crc32c(block))
                crc = crc32c_combine(crc, blocks[-1], len(block))
                if hasher is not None:
                    hasher.update(block)
            if hasher is not None:
                self.payload_digest = hasher.hexdigest()
            self.payload_at.append((self.position, tuple(blocks)))
            self._combine(crc, size)
        elif size >= _COMBINE_MIN:
            self._combine(crc32c(view), size)
        else:
            self.file_crc = crc32c(view, self.file_crc)
            self.item_crc = crc32c(view, self.item_crc)
        self.position += size
        return size

    def _combine(self, crc: int, size: int) -> None:
        self.file_crc = crc32c_combine(self.file_crc, crc, size)
        self.item_crc = crc32c_combine(self.item_crc, crc, size)

    def tell(self) -> int:
        return self.position

    def close(self) -> None:  # the upload is committed or aborted by its owner
        pass


def _item_nbytes(item: WriteItem) -> int:
    """Bytes of this rank's chunk of a tensor item (``tensor_data.size`` is the whole
    tensor's: a shard of a tensor sharded over W ranks would count W times)."""
    if item.tensor_data is None:
        return 0
    return math.prod(item.tensor_data.chunk.sizes) * torch._utils._element_size(
        item.tensor_data.properties.dtype)


#: Headroom a data file's announced size gives each item beyond its tensor bytes: a
#: tensor's archive headers (~1.6 KiB) and a byte item's pickle (size unknown up front).
_TENSOR_HEADROOM = 4096
_BYTES_HEADROOM = 64 * 1024


def _file_bytes(items: Sequence[WriteItem]) -> int:
    """About how large the data file of ``items`` will be (the size hint of its upload;
    a byte item larger than its headroom only makes it an underestimate)."""
    return sum(_item_nbytes(i) + (_BYTES_HEADROOM if i.type == WriteItemType.BYTE_IO
                                  else _TENSOR_HEADROOM) for i in items)


class _UploadWindow:
    """The memory of the data files a rank writes at once: each holds the buffer its
    upload fills before its first request (:meth:`~dcpstore.Backend.upload_memory`),
    and together they hold at most ``capacity`` bytes; a file waits for room before it
    resolves any item."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free = capacity
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        """Hold ``nbytes`` of the window (at most all of it) while the block runs."""
        n = min(nbytes, self.capacity)
        with self._cond:
            self._cond.wait_for(lambda: self._free >= n)
            self._free -= n
        try:
            yield
        finally:
            with self._cond:
                self._free += n
                self._cond.notify_all()


def _split_items(items: Sequence[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Spread items over ``bins`` files: byte items round-robin, tensors largest-first
    into the emptiest file. Empty bins are dropped. One file keeps the save plan's order
    (as torch's ``FileSystemWriter`` does), so neighbouring keys stay neighbours."""
    if bins <= 1:
        return [list(items)] if items else []
    buckets: list[list[WriteItem]] = [[] for _ in range(max(1, bins))]
    sizes = [0] * len(buckets)
    byte_items = [i for i in items if i.type == WriteItemType.BYTE_IO]
    tensors = sorted(
        (i for i in items if i.type != WriteItemType.BYTE_IO), key=_item_nbytes, reverse=True
    )
    for n, item in enumerate(byte_items):
        buckets[n % len(buckets)].append(item)
    for item in tensors:
        idx = sizes.index(min(sizes))
        buckets[idx].append(item)
        sizes[idx] += _item_nbytes(item)
    return [b for b in buckets if b]


def _pack_items(items: Sequence[WriteItem], capacity: int,
                max_files: int) -> list[list[WriteItem]]:
    """Spread items over files of at most ``capacity`` tensor bytes each: tensors
    largest-first into the first file with room (a tensor larger than ``capacity`` gets
    a file of its own), byte items (small pickles) round-robin. Where that would take
    more than ``max_files`` files, the items are spread evenly over ``max_files``
    instead (:func:`_split_items`). Empty files are dropped."""
    if capacity < 1:
        raise ValueError(f"preferred object size must be >= 1 byte, got {capacity}")
    tensors = sorted(
        (i for i in items if i.type != WriteItemType.BYTE_IO), key=_item_nbytes, reverse=True
    )
    total = sum(_item_nbytes(i) for i in tensors)
    if -(-total // capacity) > max_files:
        return _split_items(items, max_files)
    buckets: list[list[WriteItem]] = []
    sizes: list[int] = []
    for item in tensors:
        n = _item_nbytes(item)
        fits = [i for i, used in enumerate(sizes) if used + n <= capacity]
        if fits:
            idx = fits[0]
        else:
            if len(buckets) >= max_files:
                idx = sizes.index(min(sizes))
            else:
                idx = len(buckets)
                buckets.append([])
                sizes.append(0)
        buckets[idx].append(item)
        sizes[idx] += n
    if not buckets:
        buckets.append([])
    byte_items = [i for i in items if i.type == WriteItemType.BYTE_IO]
    for n, item in enumerate(byte_items):
        buckets[n % len(buckets)].append(item)
    return [b for b in buckets if b]


def payload_digest(tensor: torch.Tensor) -> str:
    """XXH3-128 of a contiguous CPU tensor's bytes, as 32 hex digits."""
    raw = tensor.reshape(-1).view(torch.uint8).numpy()
    return xxhash.xxh3_128_hexdigest(raw.data)


def _chunk_key(fqn: str, offsets: Sequence[int] | None) -> _ChunkKey:
    return fqn, tuple(int(o) for o in (offsets or ()))


def _frozen_keys(value: Any) -> frozenset[str]:
    if isinstance(value, str):
        return frozenset(k.strip() for k in value.split(",") if k.strip())
    return frozenset(value or ())


def _prepare_tensor(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        # a view into a larger storage: torch.save would write the whole storage
        tensor = tensor.clone()
    return tensor


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
    """

    _bound_as = "this Writer saves to"

    def __init__(self, backend: Backend, options: WriterOptions | None = None, *,
                 extensions: Sequence[Any] | None = None, rebind: Any = None) -> None:
        super().__init__(backend, rebind)
        self.options = options or WriterOptions()
        if self.options.files_per_rank is not None and self.options.files_per_rank < 1:
            raise ValueError(f"files_per_rank must be >= 1 or None (automatic), got "
                             f"{self.options.files_per_rank}")
        self.extensions = list(extensions) if extensions else []
        self.is_coordinator = True
        self.rank = 0
        self.save_id = layout.new_save_id()
        self._previous: Metadata | None = None
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
        self._previous = None
        self._commit_bytes = None
        self._release_base()

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.backend.uri, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        _take_pending_save_id()  # nothing left over from an earlier save on this thread
        rank = kwargs.get("rank")
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
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
        self._check_target()
        self._release_base()
        if self.options.base:
            if not all(p.usable for p in plans):
                raise errors.DcpstoreError(
                    f"{self.backend.uri}: an incremental save (base={self.options.base}) "
                    "cannot reuse a cached save plan: which bytes are references changes "
                    "with every base. Use a planner without enable_plan_caching for "
                    "incremental saves"
                )
            self._base = self._open_base(self.options.base)
        known = self._base.items if self._base is not None else {}
        out = []
        for i, plan in enumerate(plans):
            if plan.usable:
                out.append(dataclasses.replace(plan, storage_data=_Assignment(
                    rank=i, save_id=self.save_id,
                    base={key: known[key] for key in (
                        _chunk_key(item.index.fqn, item.index.offset) for item in plan.items
                        if item.type != WriteItemType.BYTE_IO) if key in known})))
            else:
                out.append(dataclasses.replace(plan, storage_data=_FreshSaveId(self.save_id)))
        if not plans[self.rank if self.rank < len(plans) else 0].usable:
            _pending.save_id = self.save_id  # this rank may get its plan without a pickle
        return out

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        assignment = self._assignment(plan)
        self.save_id = assignment.save_id
        base = assignment.base
        buckets, threads, window = self._layout(plan.items)
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

    def _layout(
        self, items: Sequence[WriteItem],
    ) -> tuple[list[list[WriteItem]], int, _UploadWindow | None]:
        """This rank's data files (their items), how many threads write them, and the
        memory window those files share (``None``: none needed).

        Explicit ``files_per_rank=N``: N files, one thread each (like torch's
        ``FileSystemWriter(thread_count=N)``). Automatic: files of at most the backend's
        :meth:`~dcpstore.Backend.preferred_object_size` (see :func:`_pack_items`; a
        tensor chunk larger than that gets a file of its own), each announced to its
        upload with its size, so the backend may send a file in one request (S3: up to
        ``part_size x max_concurrency``). Up to ``max_concurrency`` files are written
        at once, as many as the window of ``part_size x max_concurrency`` bytes holds
        their upload buffers (:meth:`~dcpstore.Backend.upload_memory`): with the parts
        in flight, a save stays within ``2 x part_size x max_concurrency`` (S3
        defaults: 4 files of up to 15 MiB at once, fewer larger ones; GCS: 16 of up to
        30 MiB). One file where the backend prefers no size.
        """
        explicit = self.options.files_per_rank
        if explicit is not None:
            buckets = _split_items(items, explicit)
            return buckets, len(buckets), None
        target = self.backend.preferred_object_size()
        if target is None:
            return _split_items(items, 1), 1, None
        buckets = _pack_items(items, target, AUTO_MAX_FILES)
        o = self.backend.options
        threads = max(1, min(len(buckets), o.max_concurrency))
        logger.debug("rank %d: %d data files of at most ~%d bytes (larger tensor chunks "
                     "alone), up to %d at once", self.rank, len(buckets), target, threads)
        return buckets, threads, _UploadWindow(o.part_size * o.max_concurrency)

    def _assignment(self, plan: SavePlan) -> _Assignment:
        """This rank's assignment for this save: the plan's own, or, for a plan torch
        took from its cache, its rank with the save id the coordinator just sent."""
        assignment = plan.storage_data
        if not isinstance(assignment, _Assignment):
            raise errors.DcpstoreError(
                "the global plan carries no dcpstore assignment; was prepare_global_plan "
                "skipped, or the plan made for another storage writer?"
            )
        fresh = _take_pending_save_id()
        if fresh is not None and fresh != assignment.save_id:
            logger.debug("cached save plan: save id %s replaces %s", fresh,
                         assignment.save_id)
            assignment = _Assignment(rank=assignment.rank, save_id=fresh)
        return assignment

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage_data: dict[Any, _StorageInfo] = {}
        files: dict[str, FileRecord] = {}
        references: dict[str, FileRecord] = {}
        referenced = 0
        for rank_results in results:
            for wr in rank_results:
                item = cast(_WrittenItem, wr.storage_data)
                storage_data[wr.index] = _StorageInfo(
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
            self._check_referenced(references)
        metadata.storage_data = storage_data
        metadata.version = _DCP_VERSION
        metadata.storage_meta = StorageMeta(checkpoint_id=self.backend.uri, save_id=self.save_id)
        metadata_bytes = pickle.dumps(metadata)
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
            self.backend.put(layout.METADATA_KEY, metadata_bytes, atomic=True)
        except BaseException as exc:
            # A PUT whose answer was lost may still have landed: then .metadata names
            # this save's files, and deleting them would destroy the checkpoint.
            landed = self._commit_landed() if isinstance(exc, Exception) else None
            if not landed:
                if landed is None:
                    logger.error("commit of %s failed and whether .metadata was replaced "
                                 "cannot be told; keeping this save's files",
                                 self.backend.uri)
                else:
                    logger.error("commit of %s failed; removing this save's files",
                                 self.backend.uri)
                    self._delete_quietly([*files, manifest_key])
                    self._release_base()
                raise
            logger.warning("commit of %s: the .metadata request failed (%s), but the store "
                           "holds this save's .metadata: committed", self.backend.uri, exc)
        self.bytes_written = manifest.total_bytes
        self.bytes_referenced = referenced
        logger.info(
            "committed %s (save %s, %d files, %.1f MB written, %.1f MB referenced)",
            self.backend.uri, self.save_id, len(files), manifest.total_bytes / 1e6,
            referenced / 1e6,
        )
        self._release_base()  # committed: the new step's references now protect them
        self._delete_stale(set(files))

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
        landed = self._commit_landed()
        if landed is not False:
            logger.warning("not removing the files of save %s at %s: its .metadata %s "
                           "committed", self.save_id, self.backend.uri,
                           "is" if landed else "may be")
            if landed:
                self._release_base()
            return landed
        self._release_base()
        keys = [o.key for o in self.backend.list("__")
                if layout.save_id_of(o.key) == self.save_id]
        keys.append(layout.manifest_key(self.save_id))
        self._delete_quietly(keys)
        if self.backend.exists(layout.METADATA_KEY):
            return False
        # nothing else there: leave no empty directory behind on local disk
        self.backend.remove_empty_dirs()
        return False

    # -- internals ---------------------------------------------------------------------

    def _commit_landed(self) -> bool | None:
        """Whether the store holds the ``.metadata`` this save sent (``None``: cannot
        tell; ``False`` also when its PUT was never attempted)."""
        if self._commit_bytes is None:
            return False
        try:
            return self.backend.get(layout.METADATA_KEY) == self._commit_bytes
        except FileNotFoundError:
            return False
        except Exception as exc:
            logger.warning("cannot read %s/.metadata back (%s)", self.backend.uri, exc)
            return None

    def _check_target(self) -> None:
        """Coordinator only: one existence check, before any rank writes."""
        try:
            raw = self.backend.get(layout.METADATA_KEY)
        except FileNotFoundError:
            return
        if not self.options.overwrite:
            raise errors.CheckpointExistsError(
                f"Checkpoint already exists at {self.backend.uri} and overwrite=False; pass "
                "overwrite=True to replace it (atomically), or save to a new location"
            )
        try:
            previous = safe_loads(raw, source=f"{self.backend.uri}/.metadata")
            self._previous = previous if isinstance(previous, Metadata) else None
        except Exception as exc:  # an unreadable old checkpoint must not block a new one
            logger.warning("existing .metadata at %s is unreadable (%s); it will be "
                           "replaced but its data files are left for `dcpstore gc`",
                           self.backend.uri, exc)

    def _open_base(self, uri: str) -> _Base | None:
        """Coordinator: pin and read the base of an incremental save (see
        :mod:`dcpstore.dcp.references` for the order of the steps and why)."""
        root, name = refs.run_root(self.backend)
        base_backend = self._rebind(uri) if self._rebind is not None else open_backend(uri)
        base = _Base(root, name, self.save_id, {}, {})
        try:
            base_root, base_name = refs.run_root(base_backend)
            if type(base_root) is not type(root) or base_root.location != root.location:
                raise errors.DcpstoreError(
                    f"the base {base_backend.uri} of an incremental save to "
                    f"{self.backend.uri} must be a sibling under the same run root "
                    f"({root.uri}); references cannot leave the run root"
                )
            if base_name == name:
                raise errors.DcpstoreError(f"the base of an incremental save cannot be its own "
                                           f"target ({self.backend.uri})")
            refs.mark_incremental(root)
            refs.write_pin(root, save_id=self.save_id, step=name, steps=[base_name])
            self._base = base  # from here on, failures remove the pin
            try:
                metadata, raw = load_metadata(base_backend)
            except errors.CheckpointNotFoundError:
                if self.options.base_required:
                    raise errors.CheckpointNotFoundError(
                        f"the base {base_backend.uri} of the incremental save to "
                        f"{self.backend.uri} is not a committed checkpoint") from None
                logger.warning("base %s is gone; saving %s in full", base_backend.uri,
                               self.backend.uri)
                return base
            source = f"{base_backend.uri}/.metadata"
            manifest = read_manifest(base_backend, layout.save_id_of_metadata(
                metadata, source=source), required=True)
            if manifest is None:
                logger.warning("base %s was not written by dcpstore (no content hashes); "
                               "saving %s in full", base_backend.uri, self.backend.uri)
                return base
            manifest.check_metadata(raw, source=source)
            holders = {validate_reference(p)[0] for p in manifest.references}
            if holders:
                refs.write_pin(root, save_id=self.save_id, step=name, steps=[base_name, *holders])
            try:  # unchanged since it was pinned, so a retention run cannot have missed it
                still = base_backend.get(layout.METADATA_KEY) == raw
            except FileNotFoundError:
                still = False
            if not still:
                logger.warning("base %s was deleted or replaced while the save to %s "
                               "started; saving in full", base_backend.uri, self.backend.uri)
                return base
            chunks = chunk_index(metadata)
            for index, info in (metadata.storage_data or {}).items():
                chunk = chunks.get(_chunk_key(index.fqn, index.offset))
                payload = manifest.item_payload(info.relative_path, info.offset)
                record = manifest.record(info.relative_path)
                if (chunk is None or payload is None or not payload.digest
                        or record is None or info.transform_descriptors):
                    continue
                crc = manifest.item_crc(info.relative_path, info.offset, info.length)
                if crc is None:
                    continue
                path = refs.reference_path(base_name, info.relative_path)
                if validate_reference(path)[0] == name:
                    continue  # bytes in this very directory: an overwrite may delete them
                base.records[path] = record
                base.items[_chunk_key(index.fqn, index.offset)] = _BaseItem(
                    path, info.offset, info.length, crc, payload, chunk[0], chunk[1])
            logger.info("incremental save to %s: base %s, %d candidate chunks",
                        self.backend.uri, base_backend.uri, len(base.items))
            return base
        except BaseException:
            if self._base is base:
                self._release_base()  # removes the pin, closes the root
            else:
                root.close()
            raise
        finally:
            base_backend.close()

    def _release_base(self) -> None:
        """Remove this save's pin and forget its base."""
        base, self._base = self._base, None
        if base is not None:
            refs.remove_pin(base.root, base.save_id)
            base.root.close()

    def _check_referenced(self, references: dict[str, FileRecord]) -> None:
        """Before the commit: every referenced file is still there, whole."""
        assert self._base is not None
        for path, record in sorted(references.items()):
            key = refs.root_key(self._base.name, path)
            try:
                size = self._base.root.stat(key).size
            except FileNotFoundError:
                size = -1
            if size != record.size:
                raise errors.IntegrityError(
                    f"{self._base.root.uri}/{key}, which this incremental save references, "
                    f"is {'gone' if size < 0 else f'{size} bytes, not {record.size}'}; "
                    "nothing was committed. Save again (in full, or with another base)"
                )

    def _delete_stale(self, keep: set[str]) -> None:
        previous = self._previous
        if previous is None:
            return
        stale = {
            getattr(info, "relative_path", None)
            for info in (previous.storage_data or {}).values()
        }
        stale.discard(None)
        old_save = getattr(previous.storage_meta, "save_id", None)
        if isinstance(old_save, str) and old_save.startswith("dcpstore-"):
            stale.add(layout.manifest_key(old_save))
        doomed = self._unreferenced(
            sorted(k for k in stale if isinstance(k, str) and k not in keep))
        if doomed:
            logger.info("deleting %d files of the overwritten checkpoint", len(doomed))
            self._delete_quietly(doomed)

    def _unreferenced(self, keys: list[str]) -> list[str]:
        """The files of an overwritten save that no other step needs: under a run root
        that held incremental saves, files a committed sibling references, or that a
        save in progress pinned, stay (``dcpstore gc`` follows the same references)."""
        try:
            root, name = refs.run_root(self.backend)
        except errors.DcpstoreError:
            return keys  # at the top of its store: no siblings
        try:
            # pins first, then committed steps (see dcpstore.dcp.references)
            pins = refs.read_pins(root)
            dirs = root.list_dirs()
            if refs.INCREMENTAL_DIR not in dirs:
                return keys  # no step here references another
            if any(name in pin.steps for pin in pins):
                needed = None
            else:
                siblings = [d for d in dirs if d != name and not d.startswith(".")
                            and root.exists(f"{d}/{layout.METADATA_KEY}")]
                needed = refs.referenced_keys(root, siblings)
        except Exception as exc:
            logger.warning("cannot tell which files of the overwritten %s other steps "
                           "reference (%s); keeping its data files for `dcpstore gc`",
                           self.backend.uri, exc)
            needed = None
        finally:
            root.close()
        if needed is None:
            return [k for k in keys if not k.endswith(layout.DATA_SUFFIX)]
        kept = [k for k in keys if f"{name}/{k}" in needed]
        if kept:
            logger.info("keeping %d files of the overwritten %s that other steps reference",
                        len(kept), self.backend.uri)
        return [k for k in keys if f"{name}/{k}" not in needed]

    def _delete_quietly(self, keys: Sequence[str]) -> None:
        try:
            self.backend.delete(keys)
        except Exception as exc:
            logger.warning("could not delete %d objects under %s (%s); `dcpstore gc` will",
                           len(keys), self.backend.uri, exc)

    def _write_file(
        self, name: str, items: Sequence[WriteItem], planner: SavePlanner,
        base: dict[_ChunkKey, _BaseItem] | None = None, size_hint: int | None = None,
    ) -> list[WriteResult]:
        started = time.perf_counter()
        upload = self.backend.open_upload(name, size_hint=size_hint)
        stream = _ChecksumStream(upload)
        transforms = _StorageWriterTransforms(self.extensions) if self.extensions else None
        written: list[tuple[WriteItem, _WrittenItem]] = []
        referenced: list[tuple[WriteItem, _WrittenItem]] = []
        records: list[tuple[int, int, int]] = []
        payloads: dict[int, Payload] = {}
        try:
            # byte items first, like torch's writer; then tensors
            ordered = sorted(items, key=lambda i: i.type != WriteItemType.BYTE_IO)
            for item in ordered:
                offset = stream.position
                stream.item_crc = 0
                data = planner.resolve_data(item)
                sink: Any = stream
                descriptors: list[str] = []
                digest = ""
                want_digest = False
                if item.type != WriteItemType.BYTE_IO:
                    if not isinstance(data, torch.Tensor):
                        raise TypeError(f"tensor item {item.index.fqn!r} resolved to {type(data)}")
                    tensor = _prepare_tensor(data)
                    hashable = (transforms is None and tensor.is_contiguous()
                                and tensor.nbytes >= _MIN_PAYLOAD)
                    same, digest = (self._unchanged(item, tensor, base) if hashable
                                    else (None, ""))
                    if same is not None:
                        ref = _WrittenItem(same.path, same.offset, same.length, None,
                                           same.crc32c, reference=True)
                        referenced.append((item, ref))
                        continue
                    want_digest = hashable and self.options.content_hash and not digest
                if transforms is not None:
                    sink, descriptors = transforms.transform_save_stream(item, stream)
                if item.type == WriteItemType.BYTE_IO:
                    if not isinstance(data, io.BytesIO):
                        raise TypeError(f"byte item {item.index.fqn!r} resolved to {type(data)}")
                    sink.write(data.getbuffer())
                else:
                    stream.expect_payload(tensor.nbytes, digest=want_digest)
                    encode_tensor(tensor, sink)
                    if (transforms is None and tensor.is_contiguous()
                            and tensor.nbytes >= _MIN_PAYLOAD and len(stream.payload_at) == 1):
                        at, crcs = stream.payload_at[0]
                        digest = digest or stream.payload_digest
                        payloads[offset] = Payload(at - offset, tensor.nbytes, crcs, digest)
                    stream.expect_payload(0)
                if transforms is not None:
                    sink.close()
                length = stream.position - offset
                record = _WrittenItem(name, offset, length, descriptors or None, stream.item_crc)
                written.append((item, record))
                records.append((offset, length, stream.item_crc))
            if not written:  # every item is referenced: no empty file
                upload.abort()
                return [WriteResult(index=item.index, size_in_bytes=0, storage_data=rec)
                        for item, rec in referenced]
            info = upload.commit()
        except BaseException:
            upload.abort()
            raise
        if info.size != stream.position:
            raise errors.DcpstoreError(
                f"{name}: backend stored {info.size} bytes, {stream.position} were written"
            )
        elapsed = time.perf_counter() - started
        logger.debug("wrote %s: %d items, %d bytes in %.3fs (%d items referenced)", name,
                     len(written), stream.position, elapsed, len(referenced))
        written[-1][1].file = FileRecord(stream.position, stream.file_crc, records, payloads)
        return [
            WriteResult(index=item.index, size_in_bytes=rec.length, storage_data=rec)
            for item, rec in written
        ] + [
            WriteResult(index=item.index, size_in_bytes=0, storage_data=rec)
            for item, rec in referenced
        ]

    def _unchanged(self, item: WriteItem, tensor: torch.Tensor,
                   base: dict[_ChunkKey, _BaseItem] | None) -> tuple[_BaseItem | None, str]:
        """The base's copy of this tensor chunk if it is the same (size, dtype, shape and
        XXH3-128; not hashed for keys the caller marked frozen), and the hash computed
        on the way (``""``: none)."""
        if not base or item.tensor_data is None:
            return None, ""
        same = base.get(_chunk_key(item.index.fqn, item.index.offset))
        if (same is None or same.dtype != tensor.dtype or same.payload.nbytes != tensor.nbytes
                or same.sizes != tuple(item.tensor_data.chunk.sizes)
                or tuple(tensor.shape) != same.sizes):
            return None, ""
        if item.index.fqn in self._frozen:
            return same, same.payload.digest
        digest = payload_digest(tensor)
        return (same if digest == same.payload.digest else None), digest
