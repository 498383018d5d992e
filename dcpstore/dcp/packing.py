"""Which data files a rank writes: its plan's items spread over files (a number of
them, or files of about the size the backend prefers), how large each file will be,
and how many are written at once."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from dcpstore.dcp.upload_window import _UploadWindow
from dcpstore.storage.backend import Backend
from dcpstore.storage.options import AUTO_MAX_FILES

__all__: list[str] = []

from dcpstore.torch_internals import element_size

logger = logging.getLogger(__name__)


def _item_nbytes(item: WriteItem) -> int:
    """Bytes of this rank's chunk of a tensor item (``tensor_data.size`` is the whole
    tensor's: a shard of a tensor sharded over W ranks would count W times)."""
    if item.tensor_data is None:
        return 0
    return math.prod(item.tensor_data.chunk.sizes) * element_size(
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


def _in_plan_order(items: Sequence[WriteItem],
                   buckets: list[list[WriteItem]]) -> list[list[WriteItem]]:
    """``buckets`` without empty ones, each in the save plan's order. Packing chooses
    which file an item goes to, never the order within one: neighbouring keys stay
    neighbours in a file (as in torch's ``FileSystemWriter``), so a reader that
    coalesces adjacent items (s3torchconnector's optimized loading) reads a run of them
    in one range."""
    position = {id(item): n for n, item in enumerate(items)}
    return [sorted(b, key=lambda item: position[id(item)]) for b in buckets if b]


def _split_items(items: Sequence[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Spread items over ``bins`` files: byte items round-robin, tensors largest-first
    into the emptiest file, each file then in plan order (:func:`_in_plan_order`).
    Empty bins are dropped."""
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
    return _in_plan_order(items, buckets)


def _pack_items(items: Sequence[WriteItem], capacity: int,
                max_files: int) -> list[list[WriteItem]]:
    """Spread items over files of at most ``capacity`` tensor bytes each: tensors
    largest-first into the first file with room (a tensor larger than ``capacity`` gets
    a file of its own), byte items (small pickles) round-robin. Where that would take
    more than ``max_files`` files, the items are spread evenly over ``max_files``
    instead (:func:`_split_items`). Empty files are dropped; each file keeps the
    plan's order (:func:`_in_plan_order`)."""
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
    return _in_plan_order(items, buckets)


def _layout(
    backend: Backend, items: Sequence[WriteItem], files_per_rank: int | None, rank: int,
) -> tuple[list[list[WriteItem]], int, _UploadWindow | None]:
    """Rank ``rank``'s data files (their items), how many threads write them, and the
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
    if files_per_rank is not None:
        buckets = _split_items(items, files_per_rank)
        return buckets, len(buckets), None
    target = backend.preferred_object_size()
    if target is None:
        return _split_items(items, 1), 1, None
    buckets = _pack_items(items, target, AUTO_MAX_FILES)
    o = backend.options
    threads = max(1, min(len(buckets), o.max_concurrency))
    logger.debug("rank %d: %d data files of at most ~%d bytes (larger tensor chunks "
                 "alone), up to %d at once", rank, len(buckets), target, threads)
    return buckets, threads, _UploadWindow(o.part_size * o.max_concurrency)
