"""The generic DCP ``StorageReader`` over any backend.

DCP calls, in this order (``dcp.load``)::

    reset(checkpoint_id)              every rank; a new load
    read_metadata()                   every rank: restricted unpickle of .metadata,
                                      stored paths validated, manifest fetched
    set_up_storage_reader(md, ...)    every rank
    prepare_local_plan(plan)          every rank (pass-through)
    prepare_global_plan(plans)        coordinator (pass-through)
    read_data(plan, planner)          every rank: group items by file, sort by offset,
                                      coalesce neighbours, fetch ranges concurrently,
                                      verify CRC32C, copy into the destination tensors

Only the byte ranges of the items in this rank's plan are fetched, and on a reshard
(N -> M) a rank that needs part of a saved chunk fetches only the payload blocks around
that part, verified against the manifest's per-block CRC32Cs (``Payload.block_crcs``),
instead of the whole item: a reshard reads about what the rank needs, not whole items
or files. Payloads are read straight into the destination tensors where their layout
allows (a scatter read), so most bytes are never copied after they arrive.
"""

from __future__ import annotations

import functools
import io
import logging
import pickle
import sys
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StorageReaderTransforms
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from . import layout
from .backend import Backend, ReadRange, uninitialized_buffer
from .checksum import block_crcs, crc32c
from .codec import ViewFile, decode_tensor
from .errors import (
    CheckpointNotFoundError,
    DcpstoreError,
    IncompleteCheckpointError,
    IntegrityError,
    UnsafeCheckpointError,
)
from .manifest import Manifest, Payload
from .safe_pickle import safe_loads
from .uri import validate_key

__all__ = ["Reader", "ReaderOptions"]

logger = logging.getLogger(__name__)


@dataclass
class ReaderOptions:
    """Options of :class:`Reader` (backend options are separate).

    Attributes:
        verify: Check every item read against the manifest's CRC32C (when the
            checkpoint has one; checkpoints written by torch's writers do not).
        coalesce_gap: Neighbouring ranges of one file closer than this many bytes are
            fetched as one request.
        max_range: Upper bound of a coalesced request (a single larger item is fetched
            whole).
        allow_pickle: Load non-tensor items with full pickle (can run code). By default
            they are loaded with ``weights_only`` semantics and anything else is refused.
        allow_unsafe_metadata: Unpickle ``.metadata`` without restriction (for custom
            planners that store their own classes in it).
    """

    verify: bool = True
    coalesce_gap: int = 1024 * 1024
    max_range: int = 64 * 1024 * 1024
    allow_pickle: bool = False
    allow_unsafe_metadata: bool = False


@dataclass
class _Partial:
    """The part of a tensor item's payload a reshard request needs.

    ``first``/``stop`` delimit the requested box, from its first to its last element,
    and ``lo``/``hi`` the whole blocks around it that are fetched and verified: byte
    offsets into the payload.
    """

    payload: Payload
    block: int
    dtype: torch.dtype
    strides: tuple[int, ...]  # row-major element strides of the saved chunk
    first: int
    stop: int
    lo: int
    hi: int
    contiguous: bool  # the box is one run of bytes (e.g. rows of a dim-0 shard)


@dataclass
class _Request:
    """One read item and the bytes of its file that serve it: the whole item, or (see
    :class:`_Partial`) whole blocks of its payload."""

    req: ReadItem
    info: _StorageInfo
    offset: int
    length: int
    partial: _Partial | None = None


@dataclass
class _Range:
    """A coalesced request and the items it carries."""

    key: str
    offset: int
    length: int
    items: list[_Request] = field(default_factory=list)


def coalesce(requests: Sequence[_Request], gap: int, max_range: int) -> list[_Range]:
    """Group read requests by file, sort by offset and merge neighbours into ranges."""
    per_file: dict[str, list[_Request]] = {}
    for request in requests:
        per_file.setdefault(request.info.relative_path, []).append(request)
    ranges: list[_Range] = []
    for key in sorted(per_file):
        current: _Range | None = None
        for request in sorted(per_file[key], key=lambda r: (r.offset, r.length)):
            end = request.offset + request.length
            if (
                current is not None
                and request.offset - (current.offset + current.length) <= gap
                and max(end, current.offset + current.length) - current.offset <= max_range
            ):
                current.length = max(end, current.offset + current.length) - current.offset
            else:
                current = _Range(key, request.offset, request.length)
                ranges.append(current)
            current.items.append(request)
    return ranges


class _LazyLayouts(Sequence[list[memoryview]]):
    """The per-range destination buffers of a read, built on first access."""

    def __init__(
        self,
        build: Callable[[int], tuple[list[memoryview], list[Callable[[], None]]]],
        count: int,
    ) -> None:
        self._build = build
        self._count = count
        self._built: dict[int, tuple[list[memoryview], list[Callable[[], None]]]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: Any) -> Any:
        if not isinstance(index, int) or not 0 <= index < self._count:
            raise IndexError(index)
        with self._lock:
            if index not in self._built:
                self._built[index] = self._build(index)
            return self._built[index][0]

    def pop(self, index: int) -> list[Callable[[], None]]:
        """The deliveries of a fetched range (its buffers are released after them)."""
        with self._lock:
            return self._built.pop(index)[1]


class Reader(StorageReader):
    """DCP storage reader over a :class:`~dcpstore.Backend`. Create with
    :func:`dcpstore.get_reader`; pass as ``storage_reader=`` to ``dcp.load``.

    Args:
        backend: Where the checkpoint is.
        options: Reader options.
        extension_registry: Decoders for DCP stream transforms (defaults to torch's).
        rebind: Function turning a ``checkpoint_id`` passed to ``dcp.load`` into a
            backend with the same options (set by :func:`dcpstore.get_reader`).
    """

    def __init__(
        self,
        backend: Backend,
        options: ReaderOptions | None = None,
        *,
        extension_registry: Any = None,
        rebind: Any = None,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.options = options or ReaderOptions()
        self._rebind = rebind
        self._transforms = _StorageReaderTransforms(extension_registry)
        self.storage_data: dict[MetadataIndex, _StorageInfo] = {}
        # (fqn, chunk offsets) -> (dtype, chunk sizes), from .metadata
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[torch.dtype, tuple[int, ...]]] = {}
        self.manifest: Manifest | None = None
        self.load_id = uuid.uuid4().hex
        #: Bytes fetched by the last ``read_data`` (coalescing gaps included).
        self.bytes_read = 0
        #: Bytes the last ``read_data`` needed (sum of its items).
        self.bytes_needed = 0
        #: Range requests issued by the last ``read_data``.
        self.requests = 0
        #: Tensor items of the last ``read_data`` whose bytes were read straight into the
        #: destination tensor (no staging buffer, no copy).
        self.items_direct = 0
        #: Tensor items of the last ``read_data`` that needed only part of a saved chunk
        #: (a reshard) and were served by fetching just the payload blocks around it.
        self.items_partial = 0
        #: Why the last ``read_metadata`` failed (DCP wraps it in an AssertionError).
        self.metadata_error: BaseException | None = None

    def __repr__(self) -> str:
        return f"Reader({self.backend.uri!r})"

    @property
    def checkpoint_id(self) -> str:
        """The URI this reader loads from."""
        return self.backend.uri

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        from .api import open_backend

        try:
            open_backend(str(checkpoint_id))
        except Exception:
            return False
        return True

    # -- DCP protocol ------------------------------------------------------------------

    def reset(self, checkpoint_id: Any = None) -> None:
        """Start a new load, optionally from another location (same backend options)."""
        if checkpoint_id is not None and str(checkpoint_id) != self.backend.uri:
            if self._rebind is None:
                raise DcpstoreError(
                    f"this Reader loads from {self.backend.uri}; create one for {checkpoint_id}"
                )
            self.backend = self._rebind(str(checkpoint_id))
        self.storage_data = {}
        self.manifest = None
        self.metadata_error = None
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Read and validate ``.metadata`` (and the manifest it names)."""
        try:
            return self._read_metadata(*args, **kwargs)
        except BaseException as exc:
            if kwargs.get("rank") is None:
                self.metadata_error = exc
            raise

    def _read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointNotFoundError(
                f"{self.backend.uri}: rank-local metadata (use_collectives=False) is not "
                "a dcpstore checkpoint format"
            )
        try:
            raw = self.backend.get(layout.METADATA_KEY)
        except FileNotFoundError:
            raise self._missing_metadata_error() from None
        metadata = self._parse_metadata(raw)
        self.manifest = self._read_manifest(metadata)
        if self.manifest is not None:
            self.manifest.check_metadata(raw, source=f"{self.backend.uri}/.metadata")
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if metadata.storage_data is None:
            raise IntegrityError(f"{self.backend.uri}/.metadata has no storage_data")
        self.storage_data = metadata.storage_data
        self._chunks = {
            (fqn, tuple(chunk.offsets)): (md.properties.dtype, tuple(chunk.sizes))
            for fqn, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
            for chunk in md.chunks
        }
        if self.manifest is None and self.options.verify:
            # read_metadata ran on another object (e.g. metadata passed in directly)
            self.manifest = self._read_manifest(metadata)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        requests = []
        for req in plan.items:
            info = self.storage_data.get(req.storage_index)
            if info is None:
                raise IntegrityError(
                    f"{self.backend.uri}/.metadata has no storage entry for "
                    f"{req.storage_index.fqn!r}"
                )
            requests.append(self._request(req, info))
        ranges = coalesce(requests, self.options.coalesce_gap, self.options.max_range)
        self.bytes_needed = sum(
            r.length if r.partial is None else r.partial.stop - r.partial.first
            for r in requests
        )
        self.bytes_read = sum(r.length for r in ranges)
        self.requests = len(ranges)
        self.items_partial = sum(r.partial is not None for r in requests)
        logger.debug("%s: %d items (%d partial) in %d ranges, %d bytes (%d needed)",
                     self.backend.uri, len(requests), self.items_partial, len(ranges),
                     self.bytes_read, self.bytes_needed)
        fetches = [ReadRange(r.key, r.offset, r.length) for r in ranges]
        self.items_direct = 0
        # Laid out when its fetch starts and dropped once delivered, so staging memory
        # stays bounded by the ranges in flight, not the whole plan.
        layouts = _LazyLayouts(lambda i: self._layout(ranges[i], planner), len(ranges))
        try:
            for index, _ in self.backend.read_ranges(fetches, layouts):
                for deliver in layouts.pop(index):
                    deliver()
        except OSError as exc:
            damaged = self._damaged_file_error(exc, ranges)
            if damaged is None:
                raise
            raise damaged from exc
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # -- internals ---------------------------------------------------------------------

    def _missing_metadata_error(self) -> Exception:
        try:
            leftovers = [o.key for o in self.backend.list("__") if o.key.endswith(".distcp")]
        except FileNotFoundError as exc:  # e.g. the bucket itself is missing: say so
            return CheckpointNotFoundError(f"no checkpoint at {self.backend.uri}: {exc}")
        if leftovers:
            return IncompleteCheckpointError(
                f"incomplete checkpoint at {self.backend.uri}: {len(leftovers)} data files "
                "but no .metadata (a save that failed or is still running). Load another "
                "checkpoint; `dcpstore gc` removes the leftovers."
            )
        return CheckpointNotFoundError(
            f"no checkpoint at {self.backend.uri} (no .metadata); check the URI"
        )

    def _damaged_file_error(self, exc: OSError, ranges: Sequence[_Range]
                            ) -> IntegrityError | None:
        """After a failed fetch, name the data file that is missing or too short and the
        items lost with it; ``None`` when that is not why (e.g. a dropped connection)."""
        if isinstance(exc, (DcpstoreError, ConnectionError, TimeoutError, PermissionError)):
            return None
        needed: dict[str, int] = {}
        for r in ranges:
            needed[r.key] = max(needed.get(r.key, 0), r.offset + r.length)
        for key in sorted(needed):
            try:
                size: int | None = self.backend.stat(key).size
            except FileNotFoundError:
                size = None
            except Exception:
                return None
            if size is not None and size >= needed[key]:
                continue
            lost = [item.req.storage_index.fqn for r in ranges if r.key == key
                    for item in r.items if size is None or item.offset + item.length > size]
            state = "is missing" if size is None else f"is truncated to {size} bytes"
            more = f" and {len(lost) - 5} more" if len(lost) > 5 else ""
            return IntegrityError(
                f"{self.backend.uri}/{key} {state}; items lost with it: "
                f"{', '.join(map(repr, lost[:5]))}{more}. The "
                "checkpoint was damaged after it was written; restore the file or load an "
                "older checkpoint."
            )
        return None

    def _parse_metadata(self, raw: bytes) -> Metadata:
        source = f"{self.backend.uri}/.metadata"
        try:
            metadata = safe_loads(raw, source=source,
                                  trusted=self.options.allow_unsafe_metadata)
        except UnsafeCheckpointError:
            raise
        except Exception as exc:
            raise IntegrityError(f"{source} is damaged and cannot be read: "
                                 f"{type(exc).__name__}: {exc}") from exc
        if not isinstance(metadata, Metadata):
            raise IntegrityError(f"{source} holds a {type(metadata).__name__}, not DCP Metadata")
        for index, info in (metadata.storage_data or {}).items():
            fields = [getattr(info, name, None) for name in ("relative_path", "offset", "length")]
            if not (isinstance(info, _StorageInfo) and isinstance(fields[0], str)
                    and all(isinstance(n, int) and n >= 0 for n in fields[1:])):
                raise IntegrityError(f"{source}: storage entry of "
                                     f"{getattr(index, 'fqn', index)!r} is malformed")
            validate_key(info.relative_path)
        return metadata

    def _read_manifest(self, metadata: Metadata) -> Manifest | None:
        if not self.options.verify:
            return None
        save_id = layout.save_id_of_metadata(metadata, source=f"{self.backend.uri}/.metadata")
        if save_id is None:
            logger.debug("%s was not written by dcpstore; no manifest to verify against",
                         self.backend.uri)
            return None
        key = layout.manifest_key(save_id)
        try:
            raw = self.backend.get(key)
        except FileNotFoundError:
            raise IntegrityError(
                f"{self.backend.uri}: the integrity manifest {key} named by .metadata is "
                "missing; the checkpoint was damaged after it was written (pass verify=False "
                "to load it unverified)"
            ) from None
        manifest = Manifest.from_bytes(raw, source=f"{self.backend.uri}/{key}")
        if manifest.save_id != save_id:
            raise IntegrityError(
                f"{self.backend.uri}/{key} belongs to save {manifest.save_id}, not {save_id}"
            )
        return manifest

    def _verify(self, req: ReadItem, info: _StorageInfo, *pieces: memoryview) -> None:
        if self.manifest is None:
            return
        got = sum(len(p) for p in pieces)
        if got != info.length:
            raise IntegrityError(
                f"{self.backend.uri}/{info.relative_path}: item {req.storage_index.fqn!r} "
                f"at offset {info.offset} is truncated ({got} of {info.length} bytes)"
            )
        expected = self.manifest.item_crc(info.relative_path, info.offset, info.length)
        if expected is None:
            raise IntegrityError(
                f"{self.backend.uri}/{info.relative_path}: item {req.storage_index.fqn!r} at "
                f"offset {info.offset} is not in the manifest; .metadata was tampered with"
            )
        actual = 0
        for piece in pieces:
            actual = crc32c(piece, actual)
        if actual != expected:
            raise IntegrityError(
                f"{self.backend.uri}/{info.relative_path}: CRC32C mismatch in item "
                f"{req.storage_index.fqn!r} (bytes {info.offset}-{info.offset + info.length}): "
                f"expected {expected:08x}, got {actual:08x}. The data file is corrupted; "
                "restore it or load an older checkpoint."
            )

    def _request(self, req: ReadItem, info: _StorageInfo) -> _Request:
        """What to fetch for one read item: the whole item, or only the payload blocks
        around the box it needs (a reshard load that needs part of a saved chunk)."""
        whole = _Request(req, info, info.offset, info.length)
        manifest = self.manifest
        if (manifest is None or not manifest.payload_block or req.type != LoadItemType.TENSOR
                or info.transform_descriptors or sys.byteorder != "little"):
            return whole
        chunk = self._chunks.get((req.storage_index.fqn, tuple(req.storage_index.offset or ())))
        payload = manifest.item_payload(info.relative_path, info.offset)
        if chunk is None or payload is None or not payload.block_crcs:
            return whole
        dtype, sizes = chunk
        offsets, lengths = tuple(req.storage_offsets), tuple(req.lengths)
        if (len(offsets) != len(sizes) or len(lengths) != len(sizes)
                or (not any(offsets) and lengths == sizes) or 0 in lengths
                or any(o < 0 or o + n > size
                       for o, n, size in zip(offsets, lengths, sizes, strict=True))):
            return whole
        itemsize = torch._utils._element_size(dtype)
        strides = [1] * len(sizes)
        for d in range(len(sizes) - 2, -1, -1):
            strides[d] = strides[d + 1] * sizes[d + 1]
        numel = strides[0] * sizes[0] if sizes else 1
        block = manifest.payload_block
        if (numel * itemsize != payload.nbytes
                or len(payload.block_crcs) != -(-payload.nbytes // block)
                or payload.start < 0 or payload.start + payload.nbytes > info.length):
            return whole
        # the box's first and last element, as byte offsets into the payload
        first = sum(o * st for o, st in zip(offsets, strides, strict=True)) * itemsize
        last = sum((o + n - 1) * st for o, n, st in zip(offsets, lengths, strides, strict=True))
        stop = (last + 1) * itemsize
        lo = first // block * block
        hi = min(-(-stop // block) * block, payload.nbytes)
        if hi - lo >= payload.nbytes:
            return whole  # the box spans (nearly) every block: read and verify the item
        box = itemsize
        for n in lengths:
            box *= n
        partial = _Partial(payload, block, dtype, tuple(strides), first, stop, lo, hi,
                           contiguous=stop - first == box)
        return _Request(req, info, info.offset + payload.start + lo, hi - lo, partial)

    def _layout(
        self, rng: _Range, planner: LoadPlanner
    ) -> tuple[list[memoryview], list[Callable[[], None]]]:
        """Where the bytes of one coalesced range go, and what to do once they are in.

        A tensor item whose payload position the manifest records, and whose whole
        chunk (or, on a reshard, whose needed run of bytes) lands in a contiguous
        destination of the same dtype, has those bytes read straight into the
        destination tensor (a scatter read); everything else (item headers and tails,
        whole blocks around a partial run, gaps, other items) goes to staging buffers.
        """
        segments: list[memoryview] = []
        deliveries: list[Callable[[], None]] = []
        staged: list[tuple[int, memoryview]] = []  # (absolute offset, buffer)
        run_start = rng.offset

        def stage(stop: int) -> None:
            nonlocal run_start
            if stop > run_start:
                buf = uninitialized_buffer(stop - run_start)
                staged.append((run_start, buf))
                segments.append(buf)
            run_start = stop

        def view(start: int, stop: int) -> memoryview:
            if start == stop:
                return memoryview(b"")
            for base, buf in staged:
                if base <= start and stop <= base + len(buf):
                    return buf[start - base : stop - base]
            raise AssertionError(f"bytes {start}-{stop} are not staged")  # pragma: no cover

        previous_end = rng.offset
        overlapping = False
        for item in rng.items:
            overlapping |= item.offset < previous_end
            previous_end = max(previous_end, item.offset + item.length)
        for item in rng.items:
            req, info = item.req, item.info
            if item.partial is not None:
                target = None if overlapping else self._partial_target(item, planner)
                if target is None:
                    deliveries.append(functools.partial(self._deliver_partial, item, view,
                                                        planner))
                    continue
                start = item.offset + item.partial.first - item.partial.lo
            else:
                direct = None if overlapping else self._direct_target(req, info, planner)
                if direct is None:
                    deliveries.append(functools.partial(self._deliver_staged, req, info, view,
                                                        planner))
                    continue
                target, start = direct[0], info.offset + direct[1]
            stage(start)
            payload = target.reshape(-1).view(torch.uint8).numpy().data.cast("B")
            segments.append(payload)
            run_start = start + len(payload)
            self.items_direct += 1
            if item.partial is not None:
                deliveries.append(functools.partial(self._deliver_partial, item, view, planner,
                                                    (start, payload, target)))
            else:
                deliveries.append(functools.partial(self._deliver_direct, req, info, view,
                                                    start, payload, target, planner))
        stage(rng.offset + rng.length)
        return segments, deliveries

    def _partial_target(self, item: _Request, planner: LoadPlanner) -> torch.Tensor | None:
        """The destination of a partial request, when its run of bytes can be read
        straight into it."""
        part = item.partial
        assert part is not None
        if not part.contiguous:
            return None
        target = planner.resolve_tensor(item.req).detach()
        if (target.device.type != "cpu" or target.dtype != part.dtype
                or not target.is_contiguous() or tuple(target.size()) != tuple(item.req.lengths)
                or target.nbytes != part.stop - part.first
                or target.is_conj() or target.is_neg()):
            return None
        return target

    def _deliver_partial(
        self, item: _Request, view: Callable[[int, int], memoryview], planner: LoadPlanner,
        direct: tuple[int, memoryview, torch.Tensor] | None = None,
    ) -> None:
        part = item.partial
        assert part is not None
        req, info = item.req, item.info
        end = item.offset + item.length
        if direct is not None:
            start, run, target = direct
            pieces = [view(item.offset, start), run, view(start + len(run), end)]
        else:
            pieces = [view(item.offset, end)]
        expected = part.payload.block_crcs[part.lo // part.block : -(-part.hi // part.block)]
        actual = block_crcs(pieces, part.block)
        if list(expected) != actual:
            bad = next(i for i, (e, a) in enumerate(zip(expected, actual, strict=True)) if e != a)
            at = info.offset + part.payload.start + part.lo + bad * part.block
            raise IntegrityError(
                f"{self.backend.uri}/{info.relative_path}: CRC32C mismatch in tensor item "
                f"{req.storage_index.fqn!r}, payload block at byte {at}: expected "
                f"{expected[bad]:08x}, got {actual[bad]:08x}. The data file is corrupted; "
                "restore it or load an older checkpoint."
            )
        if direct is None:
            run = pieces[0][part.first - part.lo : part.stop - part.lo]
            flat = torch.frombuffer(run, dtype=part.dtype)
            source = flat.as_strided(tuple(req.lengths), part.strides)
            target = planner.resolve_tensor(req).detach()
            if target.size() != source.size():
                raise IntegrityError(
                    f"{req.storage_index.fqn!r}: the checkpoint holds a chunk of shape "
                    f"{list(source.size())} where the destination expects "
                    f"{list(target.size())}"
                )
            target.copy_(source)
        planner.commit_tensor(req, target)

    def _direct_target(
        self, req: ReadItem, info: _StorageInfo, planner: LoadPlanner
    ) -> tuple[torch.Tensor, int] | None:
        """The destination tensor and the payload's start in the item, when the item's
        payload can be read straight into it."""
        if (self.manifest is None or req.type != LoadItemType.TENSOR
                or info.transform_descriptors):
            return None
        payload = self.manifest.item_payload(info.relative_path, info.offset)
        chunk = self._chunks.get((req.storage_index.fqn, tuple(req.storage_index.offset or ())))
        if payload is None or chunk is None:
            return None
        start, nbytes = payload.start, payload.nbytes
        dtype, sizes = chunk
        if (start < 0 or start + nbytes > info.length or any(req.storage_offsets)
                or tuple(req.lengths) != sizes):
            return None
        target = planner.resolve_tensor(req).detach()
        if (target.device.type != "cpu" or target.dtype != dtype or not target.is_contiguous()
                or tuple(target.size()) != sizes or target.nbytes != nbytes
                or target.is_conj() or target.is_neg()):
            return None
        return target, start

    def _deliver_direct(
        self, req: ReadItem, info: _StorageInfo, view: Callable[[int, int], memoryview],
        start: int, payload: memoryview, target: torch.Tensor, planner: LoadPlanner,
    ) -> None:
        head = view(info.offset, start)
        tail = view(start + len(payload), info.offset + info.length)
        self._verify(req, info, head, payload, tail)
        fqn = req.storage_index.fqn
        decoded = self._decode(info, fqn, [head, payload, tail])
        # the archive must place this exact tensor where the manifest said it would
        if (decoded.data_ptr() != target.data_ptr() or decoded.dtype != target.dtype
                or decoded.size() != target.size() or decoded.stride() != target.stride()):
            raise IntegrityError(
                f"{self.backend.uri}/{info.relative_path}: tensor item {fqn!r} does not lie "
                "where the manifest records its payload; the checkpoint is inconsistent"
            )
        planner.commit_tensor(req, target)

    def _deliver_staged(
        self, req: ReadItem, info: _StorageInfo, view: Callable[[int, int], memoryview],
        planner: LoadPlanner,
    ) -> None:
        self._deliver(req, info, view(info.offset, info.offset + info.length), planner)

    def _deliver(
        self, req: ReadItem, info: _StorageInfo, view: memoryview, planner: LoadPlanner
    ) -> None:
        self._verify(req, info, view)
        if info.transform_descriptors:
            source: Any = ViewFile(view)
            stream = self._transforms.transform_load_stream(
                req, info.transform_descriptors, source
            )
            view = memoryview(bytearray(stream.read()))
        fqn = req.storage_index.fqn
        if req.type == LoadItemType.BYTE_IO:
            data = bytes(view)
            if not self.options.allow_pickle:
                self._check_weights_only(fqn, info, data)
            planner.load_bytes(req, io.BytesIO(data))
            return
        tensor = self._decode(info, fqn, [view])  # shares memory with ``view``
        tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise IntegrityError(
                f"{fqn!r}: the checkpoint holds a chunk of shape {list(tensor.size())} where "
                f"the destination expects {list(target.size())}"
            )
        target.copy_(tensor)
        planner.commit_tensor(req, target)

    def _decode(self, info: _StorageInfo, fqn: str, pieces: list[memoryview]) -> torch.Tensor:
        """Decode a tensor item (zero-copy), with errors that name file and item."""
        try:
            return decode_tensor(pieces)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(
                f"{self.backend.uri}/{info.relative_path}: tensor item {fqn!r} is not a plain "
                f"tensor ({exc})"
            ) from exc
        except RuntimeError as exc:
            raise IntegrityError(
                f"{self.backend.uri}/{info.relative_path}: tensor item {fqn!r} at offset "
                f"{info.offset} cannot be decoded: {exc}"
            ) from exc

    def _check_weights_only(self, fqn: str, info: _StorageInfo, data: bytes) -> None:
        try:
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(
                f"{self.backend.uri}/{info.relative_path}: item {fqn!r} is a pickle that "
                f"weights_only loading refuses ({str(exc).splitlines()[0]}). It could run "
                "code. If you trust this checkpoint, load with allow_pickle=True."
            ) from exc
