"""Buffer layout and delivery: where fetched bytes land, and how they reach the tensors.

For each :class:`~dcpstore.dcp.read_plan.CoalescedRange`, :meth:`Delivery.layout` lays out
the buffers the backend reads into (a scatter read): a tensor payload whose destination
allows it is read straight into the destination tensor; everything else (item headers
and tails, whole blocks around a partial run, gaps, other items) goes to staging
buffers. Once the range is in, its deliveries verify what arrived against the manifest
(item CRC32C, or :class:`~dcpstore.dcp.checksum.BlockCRCs` of a reshard's blocks), decode,
copy out of staging where needed and commit each item to the planner. A large payload
read straight into its tensor is checksummed by the read itself, while its bytes are in
the CPU's cache (``read_ranges(checksums=...)``); its item's CRC32C is then that
checksum combined with the header's and the tail's.

:func:`fetch_and_deliver` drives one load's ranges through the backend, laying each out
when its fetch starts and delivering it as soon as it is in, so staging memory stays
bounded by the ranges in flight.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import logging
import pickle
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from dcpstore import errors
from dcpstore.dcp.checksum import block_crcs, crc32c, crc32c_combine
from dcpstore.dcp.codec import ViewFile, decode_tensor
from dcpstore.dcp.manifest import Manifest
from dcpstore.dcp.read_plan import ChunkIndex, CoalescedRange, ItemRead
from dcpstore.storage.backend import Backend, ReadRange, uninitialized_buffer
from dcpstore.torch_internals import StorageInfo, StorageReaderTransforms, narrow_tensor_by_index

__all__ = ["Delivery", "LazyLayouts", "fetch_and_deliver"]

logger = logging.getLogger(__name__)

#: The buffers one range is read into, what to run once they are filled, and the
#: buffers whose CRC32C the read computes (index -> CRC32C, ``None`` until read).
Layout = tuple[list[memoryview], list[Callable[[], None]], dict[int, int | None]]

#: Payloads from this size are checksummed by the read (below it, the combine costs
#: more than the second pass saves).
_CHECKSUM_WHILE_READING = 1024 * 1024


@dataclasses.dataclass(eq=False, repr=False)
class Delivery:
    """Lays out the buffers of a load's ranges and delivers their items.

    Args:
        uri: The checkpoint's URI (for error messages).
        planner: The load's planner: where tensors go, what takes bytes.
        manifest: The integrity manifest; ``None`` loads unverified.
        chunks: The saved tensor chunks (:func:`~dcpstore.dcp.read_plan.chunk_index`).
        transforms: Decoders for DCP stream transforms.
        allow_pickle: Load non-tensor items with full pickle.
    """

    uri: str
    planner: LoadPlanner
    manifest: Manifest | None
    chunks: ChunkIndex
    transforms: StorageReaderTransforms
    _: dataclasses.KW_ONLY
    allow_pickle: bool = False
    #: Tensor items read straight into their destination so far.
    items_direct: int = dataclasses.field(default=0, init=False)

    def layout(self, rng: CoalescedRange) -> Layout:
        """Where the bytes of one coalesced range go, and what to do once they are in.

        A tensor item whose payload position the manifest records, and whose whole
        chunk (or, on a reshard, whose needed run of bytes) lands in a contiguous
        destination of the same dtype, has those bytes read straight into the
        destination tensor (a scatter read); everything else (item headers and tails,
        whole blocks around a partial run, gaps, other items) goes to staging buffers.
        """
        segments: list[memoryview] = []
        deliveries: list[Callable[[], None]] = []
        checksums: dict[int, int | None] = {}
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
                target = None if overlapping else self._partial_target(item)
                if target is None:
                    deliveries.append(functools.partial(self._deliver_partial, item, view))
                    continue
                start = item.offset + item.partial.first - item.partial.lo
            else:
                direct = None if overlapping else self._direct_target(req, info)
                if direct is None:
                    deliveries.append(functools.partial(self._deliver_staged, req, info, view))
                    continue
                target, start = direct[0], info.offset + direct[1]
            stage(start)
            payload = target.reshape(-1).view(torch.uint8).numpy().data.cast("B")
            segment = len(segments)
            if item.partial is None and len(payload) >= _CHECKSUM_WHILE_READING:
                checksums[segment] = None
            segments.append(payload)
            run_start = start + len(payload)
            self.items_direct += 1
            if item.partial is not None:
                deliveries.append(functools.partial(self._deliver_partial, item, view,
                                                    (start, payload, target)))
            else:
                deliveries.append(functools.partial(
                    self._deliver_direct, req, info, view, start, payload, target,
                    functools.partial(checksums.get, segment)))
        stage(rng.offset + rng.length)
        return segments, deliveries, checksums

    # -- scatter destinations ----------------------------------------------------------

    def _partial_target(self, item: ItemRead) -> torch.Tensor | None:
        """The destination of a partial request, when its run of bytes can be read
        straight into it."""
        part = item.partial
        assert part is not None
        if not part.contiguous:
            return None
        target = self.planner.resolve_tensor(item.req).detach()
        if (target.device.type != "cpu" or target.dtype != part.dtype
                or not target.is_contiguous() or tuple(target.size()) != tuple(item.req.lengths)
                or target.nbytes != part.stop - part.first
                or target.is_conj() or target.is_neg()):
            return None
        return target

    def _direct_target(self, req: ReadItem, info: StorageInfo
                       ) -> tuple[torch.Tensor, int] | None:
        """The destination tensor and the payload's start in the item, when the item's
        payload can be read straight into it."""
        if (self.manifest is None or req.type != LoadItemType.TENSOR
                or info.transform_descriptors):
            return None
        payload = self.manifest.item_payload(info.relative_path, info.offset)
        chunk = self.chunks.get((req.storage_index.fqn, tuple(req.storage_index.offset or ())))
        if payload is None or chunk is None:
            return None
        start, nbytes = payload.start, payload.nbytes
        dtype, sizes = chunk
        if (start < 0 or start + nbytes > info.length or any(req.storage_offsets)
                or tuple(req.lengths) != sizes):
            return None
        target = self.planner.resolve_tensor(req).detach()
        if (target.device.type != "cpu" or target.dtype != dtype or not target.is_contiguous()
                or tuple(target.size()) != sizes or target.nbytes != nbytes
                or target.is_conj() or target.is_neg()):
            return None
        return target, start

    # -- deliveries --------------------------------------------------------------------

    def _deliver_partial(
        self, item: ItemRead, view: Callable[[int, int], memoryview],
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
            raise errors.IntegrityError(
                f"{self.uri}/{info.relative_path}: CRC32C mismatch in tensor item "
                f"{req.storage_index.fqn!r}, payload block at byte {at}: expected "
                f"{expected[bad]:08x}, got {actual[bad]:08x}. The data file is corrupted; "
                "restore it or load an older checkpoint."
            )
        if direct is None:
            run = pieces[0][part.first - part.lo : part.stop - part.lo]
            flat = torch.frombuffer(run, dtype=part.dtype)
            source = flat.as_strided(tuple(req.lengths), part.strides)
            target = self.planner.resolve_tensor(req).detach()
            if target.size() != source.size():
                raise errors.IntegrityError(
                    f"{req.storage_index.fqn!r}: the checkpoint holds a chunk of shape "
                    f"{list(source.size())} where the destination expects "
                    f"{list(target.size())}"
                )
            target.copy_(source)
        self.planner.commit_tensor(req, target)

    def _deliver_direct(
        self, req: ReadItem, info: StorageInfo, view: Callable[[int, int], memoryview],
        start: int, payload: memoryview, target: torch.Tensor,
        payload_crc: Callable[[], int | None] = lambda: None,
    ) -> None:
        head = view(info.offset, start)
        tail = view(start + len(payload), info.offset + info.length)
        self._verify(req, info, head, payload, tail, payload_crc=payload_crc())
        fqn = req.storage_index.fqn
        decoded = self._decode(info, fqn, [head, payload, tail])
        # the archive must place this exact tensor where the manifest said it would
        if (decoded.data_ptr() != target.data_ptr() or decoded.dtype != target.dtype
                or decoded.size() != target.size() or decoded.stride() != target.stride()):
            raise errors.IntegrityError(
                f"{self.uri}/{info.relative_path}: tensor item {fqn!r} does not lie "
                "where the manifest records its payload; the checkpoint is inconsistent"
            )
        self.planner.commit_tensor(req, target)

    def _deliver_staged(
        self, req: ReadItem, info: StorageInfo, view: Callable[[int, int], memoryview],
    ) -> None:
        self._deliver(req, info, view(info.offset, info.offset + info.length))

    def _deliver(self, req: ReadItem, info: StorageInfo, view: memoryview) -> None:
        self._verify(req, info, view)
        if info.transform_descriptors:
            source: Any = ViewFile(view)
            stream = self.transforms.transform_load_stream(
                req, info.transform_descriptors, source
            )
            view = memoryview(bytearray(stream.read()))
        fqn = req.storage_index.fqn
        if req.type == LoadItemType.BYTE_IO:
            data = bytes(view)
            if not self.allow_pickle:
                self._check_weights_only(fqn, info, data)
            self.planner.load_bytes(req, io.BytesIO(data))
            return
        tensor = self._decode(info, fqn, [view])  # shares memory with ``view``
        tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        target = self.planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise errors.IntegrityError(
                f"{fqn!r}: the checkpoint holds a chunk of shape {list(tensor.size())} where "
                f"the destination expects {list(target.size())}"
            )
        target.copy_(tensor)
        self.planner.commit_tensor(req, target)

    # -- checks ------------------------------------------------------------------------

    def _verify(self, req: ReadItem, info: StorageInfo, *pieces: memoryview,
                payload_crc: int | None = None) -> None:
        """Check a whole item's bytes (``pieces`` in order) against the manifest.
        ``payload_crc``: the CRC32C of the middle one of three (head, payload, tail),
        computed by the read; the payload is then not read again."""
        if self.manifest is None:
            return
        got = sum(len(p) for p in pieces)
        if got != info.length:
            raise errors.IntegrityError(
                f"{self.uri}/{info.relative_path}: item {req.storage_index.fqn!r} "
                f"at offset {info.offset} is truncated ({got} of {info.length} bytes)"
            )
        expected = self.manifest.item_crc(info.relative_path, info.offset, info.length)
        if expected is None:
            raise errors.IntegrityError(
                f"{self.uri}/{info.relative_path}: item {req.storage_index.fqn!r} at "
                f"offset {info.offset} is not in the manifest; .metadata was tampered with"
            )
        if payload_crc is not None and len(pieces) == 3:
            head, payload, tail = pieces
            actual = crc32c(tail, crc32c_combine(crc32c(head), payload_crc, len(payload)))
        else:
            actual = 0
            for piece in pieces:
                actual = crc32c(piece, actual)
        if actual != expected:
            raise errors.IntegrityError(
                f"{self.uri}/{info.relative_path}: CRC32C mismatch in item "
                f"{req.storage_index.fqn!r} (bytes {info.offset}-{info.offset + info.length}): "
                f"expected {expected:08x}, got {actual:08x}. The data file is corrupted; "
                "restore it or load an older checkpoint."
            )

    def _decode(self, info: StorageInfo, fqn: str, pieces: list[memoryview]) -> torch.Tensor:
        """Decode a tensor item (zero-copy), with errors that name file and item."""
        try:
            return decode_tensor(pieces)
        except pickle.UnpicklingError as exc:
            raise errors.UnsafeCheckpointError(
                f"{self.uri}/{info.relative_path}: tensor item {fqn!r} is not a plain "
                f"tensor ({exc})"
            ) from exc
        except RuntimeError as exc:
            raise errors.IntegrityError(
                f"{self.uri}/{info.relative_path}: tensor item {fqn!r} at offset "
                f"{info.offset} cannot be decoded: {exc}"
            ) from exc

    def _check_weights_only(self, fqn: str, info: StorageInfo, data: bytes) -> None:
        try:
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise errors.UnsafeCheckpointError(
                f"{self.uri}/{info.relative_path}: item {fqn!r} is a pickle that "
                f"weights_only loading refuses ({str(exc).splitlines()[0]}). It could run "
                "code. If you trust this checkpoint, load with allow_pickle=True."
            ) from exc


class LazyLayouts(Sequence[list[memoryview]]):
    """The per-range destination buffers of a read, built on first access."""

    def __init__(self, build: Callable[[int], Layout], count: int) -> None:
        self._build = build
        self._count = count
        self._built: dict[int, Layout] = {}
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

    def checksums(self) -> Sequence[dict[int, int | None]]:
        """Per range, the buffers whose CRC32C the read computes (``read_ranges``'
        ``checksums``), built with its buffers."""
        return _Checksums(self)

    def checksums_of(self, index: int) -> dict[int, int | None]:
        self[index]
        with self._lock:
            return self._built[index][2]

    def pop(self, index: int) -> list[Callable[[], None]]:
        """The deliveries of a fetched range (its buffers are released after them)."""
        with self._lock:
            return self._built.pop(index)[1]


class _Checksums(Sequence[dict[int, int | None]]):
    def __init__(self, layouts: LazyLayouts) -> None:
        self._layouts = layouts

    def __len__(self) -> int:
        return len(self._layouts)

    def __getitem__(self, index: Any) -> Any:
        return self._layouts.checksums_of(index)


def fetch_and_deliver(backend: Backend, ranges: Sequence[CoalescedRange],
                      delivery: Delivery) -> None:
    """Fetch ``ranges`` concurrently into the buffers ``delivery`` lays out, and deliver
    each range's items as soon as it is in.

    Raises:
        errors.IntegrityError: A data file is missing or too short (naming the items lost with
            it), or what arrived does not match the manifest.
        OSError: The store failed otherwise.
    """
    fetches = [ReadRange(r.key, r.offset, r.length) for r in ranges]
    # Laid out when its fetch starts and dropped once delivered, so staging memory
    # stays bounded by the ranges in flight, not the whole plan.
    layouts = LazyLayouts(lambda i: delivery.layout(ranges[i]), len(ranges))
    try:
        for index, _ in backend.read_ranges(fetches, layouts, layouts.checksums()):
            for deliver in layouts.pop(index):
                deliver()
    except OSError as exc:
        damaged = damaged_file_error(backend, exc, ranges)
        if damaged is None:
            raise
        raise damaged from exc


def damaged_file_error(backend: Backend, exc: OSError, ranges: Sequence[CoalescedRange]
                       ) -> errors.IntegrityError | None:
    """After a failed fetch, name the data file that is missing or too short and the
    items lost with it; ``None`` when that is not why (e.g. a dropped connection)."""
    store_said_missing = isinstance(exc, errors.ObjectNotFoundError)
    if isinstance(exc, (ConnectionError, TimeoutError, PermissionError)) or (
            isinstance(exc, errors.DcpstoreError) and not store_said_missing):
        return None
    needed: dict[str, int] = {}
    for r in ranges:
        needed[r.key] = max(needed.get(r.key, 0), r.offset + r.length)
    for key in sorted(needed):
        try:
            size: int | None = backend.stat(key).size
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
        return errors.IntegrityError(
            f"{backend.uri}/{key} {state}; items lost with it: "
            f"{', '.join(map(repr, lost[:5]))}{more}. The "
            "checkpoint was damaged after it was written; restore the file or load an "
            "older checkpoint."
        )
    return None
