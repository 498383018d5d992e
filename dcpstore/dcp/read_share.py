"""Read once, share: bytes several ranks need are fetched from the store by one of them
and sent to the others over the process group.

Every data-parallel replica of a model loads the same bytes (DDP and HSDP replicas, norms
and biases under tensor parallelism, optimizer scalars). Fetching them once and sending
them rank to rank turns N store reads of a replicated byte into one, and spreads the
fetching over the ranks.

- :func:`share_context` turns the load's process group into the group the bytes travel
  over: the load's own when its backend moves CPU tensors (gloo), else a gloo side group
  made once over the world (an NCCL world). The reader knows the load's group when it
  was given one (``get_reader(process_group=...)``; :func:`dcpstore.load` always gives
  it); otherwise the coordinator finds it from the plans DCP hands it (one per rank of
  the world) and tells the other ranks in their plans.
- :func:`broadcast_blobs` sends the coordinator's byte strings (``.metadata`` and the
  manifest) or its error to every rank, so only the coordinator asks the store.
- :func:`plan_sharing` (coordinator, ``prepare_global_plan``) finds the byte ranges
  that several ranks' plans need and gives each to one of them, balancing bytes; the
  result travels to each rank in its ``LoadPlan.storage_data``.
- :func:`exchange` (every rank, ``read_data``) runs the schedule window by window:
  owners fetch their ranges, all ranks agree that every fetch worked, then each owner
  sends one message per receiving rank (raw ``uint8`` tensors, point to point), and
  every rank delivers what it got through :class:`~dcpstore.dcp.delivery.Delivery`, which
  verifies it against the manifest's CRC32Cs like bytes fetched from the store.

Every rank runs the same sequence of collectives. A rank that fails (a fetch, a CRC
mismatch) says so at the next window's status exchange, and all ranks stop there
together; nothing waits for a message that will never come.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dcpstore.dcp.delivery import Delivery, damaged_file_error
from dcpstore.dcp.read_plan import CoalescedRange, ItemRead
from dcpstore.errors import IncompleteCheckpointError, decode_error, encode_error
from dcpstore.storage.backend import Backend, ReadRange, uninitialized_buffer
from dcpstore.torch_internals import group_timeout

__all__ = [
    "MIN_PIECE",
    "WINDOW_BYTES",
    "ExchangeStats",
    "PeerReadError",
    "Piece",
    "RankShare",
    "ShareContext",
    "SharedUnit",
    "broadcast_blobs",
    "exchange",
    "plan_sharing",
    "share_context",
    "unit_key",
]

logger = logging.getLogger(__name__)

#: Upper bound of the shared bytes one window holds (each rank buffers at most the
#: units it owns or receives in one window, plus a single larger unit).
WINDOW_BYTES = 64 * 1024 * 1024

#: Smallest piece a shared unit is split into, so that one large tensor is fetched by
#: several ranks (each range request still reaches the store's full speed).
MIN_PIECE = 8 * 1024 * 1024

#: ``(relative_path, offset, length)``: the bytes one read request fetches.
UnitKey = tuple[str, int, int]

_SIDE_GROUPS: dict[Any, Any] = {}


class PeerReadError(RuntimeError):
    """Another rank could not fetch or deliver bytes this load shares; its own error says
    why (DCP reports every rank's failure; :func:`dcpstore.load` raises the most specific
    one)."""


@dataclass(frozen=True)
class ShareContext:
    """Where a load's ranks share bytes.

    Attributes:
        group: The transport group (DCP's own, or a gloo side group over the same ranks).
        rank: This rank in it.
        size: Ranks in it.
        coordinator: The coordinator's rank in it.
    """

    group: Any
    rank: int
    size: int
    coordinator: int

    @property
    def is_coordinator(self) -> bool:
        """Whether this rank is DCP's coordinator."""
        return self.rank == self.coordinator


def _moves_cpu_tensors(group: Any) -> bool:
    return any(name in str(dist.get_backend(group)) for name in ("gloo", "mpi"))


def share_context(group: Any, coordinator: int = 0) -> ShareContext | None:
    """Where the ranks of a load over ``group`` (``None``: the world) share bytes, or
    ``None`` when there is no one to share with (no process group, one rank, or a group
    whose backend cannot move CPU tensors and is not the world).

    Args:
        group: The load's process group (DCP's ``process_group``).
        coordinator: DCP's coordinator, as a rank of ``group``.

    Collective when it returns a context for the first time over an NCCL-only world: it
    makes the gloo side group there (every rank of the load calls it at the same point).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    size = dist.get_world_size(group)
    if size < 2:
        return None
    rank = dist.get_rank(group)
    if _moves_cpu_tensors(group):
        return ShareContext(group, rank, size, coordinator)
    world = dist.group.WORLD
    if group is not None and group is not world:
        logger.info("read sharing is off: the load's process group (%s) cannot move CPU "
                    "tensors and is not the world, where a gloo side group could be made",
                    dist.get_backend(group))
        return None
    if world not in _SIDE_GROUPS:
        # with the world's timeout: new_group's default is 30 minutes whatever it is
        _SIDE_GROUPS[world] = dist.new_group(backend="gloo", timeout=group_timeout(world))
    return ShareContext(_SIDE_GROUPS[world], rank, size, coordinator)


# -- the coordinator's reads, broadcast ---------------------------------------------------


def _error_payload(exc: BaseException) -> bytes:
    return encode_error(exc)


def _error_from_payload(raw: bytes, coordinator: int) -> BaseException:
    return decode_error(raw, f" (read by rank {coordinator}, the coordinator)")


def broadcast_blobs(ctx: ShareContext, produce: Callable[[], Sequence[bytes | None]],
                    count: int) -> list[bytes | None]:
    """Run ``produce`` on the coordinator only and give its ``count`` byte strings (or
    ``None`` s) to every rank; its error is raised on every rank (same type and message).

    Args:
        ctx: The load's ranks.
        produce: What the coordinator reads (e.g. ``.metadata`` and the manifest).
        count: How many byte strings ``produce`` returns.
    """
    header = torch.zeros(count + 1, dtype=torch.int64)  # status, then each length (-1: None)
    payload: bytes = b""
    error: BaseException | None = None
    if ctx.is_coordinator:
        try:
            blobs = list(produce())
            if len(blobs) != count:
                raise AssertionError(f"produce returned {len(blobs)} blobs, not {count}")
            header[1:] = torch.tensor([-1 if b is None else len(b) for b in blobs])
            payload = b"".join(b for b in blobs if b is not None)
        except BaseException as exc:
            error = exc
            payload = _error_payload(exc)
            header[0], header[1] = 1, len(payload)
    dist.broadcast(header, group_src=ctx.coordinator, group=ctx.group)
    failed = bool(header[0])
    total = int(header[1]) if failed else int(header[1:].clamp(min=0).sum())
    data = torch.empty(total, dtype=torch.uint8)
    if ctx.is_coordinator:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if total else data
    if total:
        dist.broadcast(data, group_src=ctx.coordinator, group=ctx.group)
    raw = data.numpy().tobytes()
    if failed:
        if error is not None:
            raise error
        raise _error_from_payload(raw, ctx.coordinator)
    out: list[bytes | None] = []
    pos = 0
    for n in header[1:].tolist():
        if n < 0:
            out.append(None)
        else:
            out.append(raw[pos : pos + n])
            pos += n
    return out


# -- which rank fetches what --------------------------------------------------------------


def unit_key(request: ItemRead) -> UnitKey:
    """The bytes a read request fetches."""
    return (request.info.relative_path, request.offset, request.length)


@dataclass(frozen=True)
class Piece:
    """Part of a shared unit: fetched by ``owner`` and sent to the unit's other needers."""

    key: UnitKey
    owner: int


@dataclass(frozen=True)
class SharedUnit:
    """Bytes that several ranks (``needers``) need, or that the one rank needing them
    cannot read itself, in ``pieces`` fetched by one rank each (a needer where one can
    read the file; a large unit is split, so that no rank fetches much more than its
    share). An owner that is not among the needers only fetches and sends."""

    key: UnitKey
    needers: tuple[int, ...]  # empty in the plan of a rank that sends none of it
    pieces: tuple[Piece, ...]

    def needed_by(self, rank: int) -> bool:
        """Whether ``rank`` (whose plan holds this unit) receives and delivers it."""
        return not self.needers or rank in self.needers


@dataclass
class RankShare:
    """One rank's part of the sharing schedule (carried in ``LoadPlan.storage_data``).

    Attributes:
        windows: Per window, the shared units this rank owns or receives, in the order
            every rank uses. Every rank has the same number of windows.
        shared_bytes: Bytes of all shared units (every rank's), for the log.
    """

    windows: list[list[SharedUnit]] = field(default_factory=list)
    shared_bytes: int = 0


def _split(key: UnitKey, ways: int, min_piece: int) -> list[UnitKey]:
    path, offset, length = key
    count = max(1, min(ways, length // max(min_piece, 1)))
    step = -(-length // count)
    return [(path, offset + lo, min(step, length - lo)) for lo in range(0, length, step)]


def plan_sharing(requests: Sequence[Sequence[ItemRead]], *,
                 window_bytes: int | None = None, min_piece: int | None = None,
                 holders: Mapping[str, Collection[int]] | None = None) -> list[RankShare]:
    """Give every byte range that two or more ranks need to one of them; with
    ``holders``, also every range that the one rank needing it cannot read.

    A range of at least twice ``min_piece`` is split into up to one piece per rank that
    needs it. Owners are chosen among those ranks in file order: a rank keeps the pieces
    that follow its last one while it fetches no more than its fair share (its part of
    every range it needs) plus a piece, else the piece goes to the rank furthest below
    its share. With ``holders``, only ranks that hold the file own its pieces: needers
    that hold it where there are any, else the holders (who then fetch and send only).
    The units are cut, in file order, into windows of about ``window_bytes`` (a unit is
    never split over windows).

    Args:
        requests: Each rank's read requests (:func:`~dcpstore.dcp.read_plan.plan_reads`).
        window_bytes: Shared bytes per window (default :data:`WINDOW_BYTES`).
        min_piece: Smallest piece a unit is split into (default :data:`MIN_PIECE`).
        holders: For each file (``relative_path``), the ranks that can read it (a
            node-local tier across hosts: the ranks of the hosts holding a copy). A file
            it does not name, or ``None``: every rank reads it itself.

    Returns:
        One :class:`RankShare` per rank (all with the same number of windows).

    Raises:
        IncompleteCheckpointError: A needed file has no holder.
    """
    needers: dict[UnitKey, set[int]] = {}
    for rank, reqs in enumerate(requests):
        for req in reqs:
            needers.setdefault(unit_key(req), set()).add(rank)
    fetchers = {k: _fetchers(k[0], r, holders) for k, r in needers.items()}
    shared = {k: tuple(sorted(r)) for k, r in needers.items()
              if len(r) >= 2 or not set(r) <= set(fetchers[k])}
    piece_size = MIN_PIECE if min_piece is None else min_piece
    window = WINDOW_BYTES if window_bytes is None else window_bytes
    pieces = {k: _split(k, len(fetchers[k]), piece_size) for k in shared}
    # each rank's fair share: its part of every piece it needs
    fair = [0.0] * len(requests)
    for key, ranks in shared.items():
        for rank in ranks:
            fair[rank] += key[2] / len(ranks)
    load = [0] * len(requests)
    owners: dict[UnitKey, int] = {}
    previous: tuple[str, int] | None = None  # (file, owner) of the last piece
    # in file order, a rank keeps fetching neighbouring pieces while under its share:
    # each rank's pieces form long runs, fetched in few requests
    for key, piece in sorted(((k, p) for k in shared for p in pieces[k]),
                             key=lambda kp: kp[1]):
        ranks = fetchers[key]
        if (previous is not None and previous[0] == piece[0] and previous[1] in ranks
                and load[previous[1]] + piece[2] <= fair[previous[1]] + piece_size):
            owner = previous[1]
        else:
            owner = min(ranks, key=lambda r: (load[r] - fair[r], r))
        owners[piece] = owner
        load[owner] += piece[2]
        previous = (piece[0], owner)
    windows: list[list[SharedUnit]] = []
    size = 0
    for key in sorted(shared):
        if not windows or (size and size + key[2] > window):
            windows.append([])
            size = 0
        windows[-1].append(SharedUnit(key, shared[key],
                                      tuple(Piece(p, owners[p]) for p in pieces[key])))
        size += key[2]
    total = sum(k[2] for k in shared)
    return [RankShare([[_for_rank(u, rank) for u in w
                        if rank in u.needers or any(p.owner == rank for p in u.pieces)]
                       for w in windows], total)
            for rank in range(len(requests))]


def _fetchers(path: str, needers: set[int], holders: Mapping[str, Collection[int]] | None
              ) -> tuple[int, ...]:
    """The ranks that may fetch a unit of ``path`` that ``needers`` need."""
    held = None if holders is None else holders.get(path)
    if held is None:  # not named: every rank reads it itself
        return tuple(sorted(needers))
    if not held:
        raise IncompleteCheckpointError(
            f"{path}: no rank of this load can read it (no host holds a copy); "
            "load from the root instead")
    return tuple(sorted(set(held) & needers or set(held)))


def _for_rank(unit: SharedUnit, rank: int) -> SharedUnit:
    """``unit`` as ``rank`` needs to know it: who needs it only where ``rank`` sends some
    of it (keeps each rank's plan small at large world sizes)."""
    if any(p.owner == rank for p in unit.pieces):
        return unit
    return SharedUnit(unit.key, (), unit.pieces)


# -- running the schedule -----------------------------------------------------------------


@dataclass
class ExchangeStats:
    """What :func:`exchange` moved on this rank."""

    bytes_fetched: int = 0
    requests: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0


def _merge(units: Sequence[Piece], others: set[tuple[str, int]], gap: int, max_range: int
           ) -> list[tuple[ReadRange, list[Piece]]]:
    """Owned pieces of one window merged into range requests like the private ones,
    where no other rank's piece (``others``: their files and offsets) lies between."""
    starts: dict[str, list[int]] = {}
    for path, offset in others:
        starts.setdefault(path, []).append(offset)
    for offsets in starts.values():
        offsets.sort()
    merged: list[tuple[ReadRange, list[Piece]]] = []
    for unit in sorted(units, key=lambda u: u.key):
        path, offset, length = unit.key
        if merged:
            last, members = merged[-1]
            end = max(last.offset + last.length, offset + length)
            between = starts.get(path, [])
            if (last.key == path and offset - (last.offset + last.length) <= gap
                    and end - last.offset <= max_range and offset >= last.offset
                    and bisect.bisect_left(between, last.offset + last.length)
                    == bisect.bisect_left(between, offset)):
                merged[-1] = (ReadRange(path, last.offset, end - last.offset), members)
                members.append(unit)
                continue
        merged.append((ReadRange(path, offset, length), [unit]))
    return merged


def _fetch(backend: Backend, units: Sequence[Piece], others: set[tuple[str, int]],
           mine: dict[UnitKey, list[ItemRead]], gap: int, max_range: int,
           stats: ExchangeStats, key_of: Callable[[str], str] | None = None
           ) -> dict[UnitKey, memoryview]:
    """Fetch the pieces this rank owns; each piece's bytes, by key (``key_of`` maps a
    unit's path to the backend's key)."""
    merged = _merge(units, others, gap, max_range)
    if key_of is not None:
        merged = [(dataclasses.replace(r, key=key_of(r.key)), m) for r, m in merged]
    buffers = [uninitialized_buffer(r.length) for r, _ in merged]
    stats.requests += len(merged)
    stats.bytes_fetched += sum(r.length for r, _ in merged)
    try:
        for _ in backend.read_ranges([r for r, _ in merged], buffers):
            pass
    except OSError as exc:
        ranges = [CoalescedRange(key_of(u.key[0]) if key_of else u.key[0], u.key[1],
                                 u.key[2], [i for k, items in mine.items() for i in items
                                  if k[0] == u.key[0] and k[1] <= u.key[1] < k[1] + k[2]])
                  for u in units]
        damaged = damaged_file_error(backend, exc, ranges)
        if damaged is None:
            raise
        raise damaged from exc
    out: dict[UnitKey, memoryview] = {}
    for (rng, members), buf in zip(merged, buffers, strict=True):
        for unit in members:
            start = unit.key[1] - rng.offset
            out[unit.key] = buf[start : start + unit.key[2]]
    return out


def _deliver(delivery: Delivery, key: UnitKey, items: list[ItemRead],
             chunks: Sequence[memoryview]) -> None:
    """Deliver one unit's bytes (``chunks``, in order) through the same layout and checks
    as a fetched range: copied once, into the buffers a fetch would have filled."""
    # (the checksums a read would compute are left to the deliveries: these bytes were
    # copied, not read)
    segments, deliveries, _ = delivery.layout(CoalescedRange(key[0], key[1], key[2], items))
    sources = iter(chunks)
    source, at = memoryview(b""), 0
    for segment in segments:
        filled = 0
        while filled < len(segment):
            if at == len(source):
                source, at = next(sources), 0
                continue
            n = min(len(segment) - filled, len(source) - at)
            segment[filled : filled + n] = source[at : at + n]
            filled += n
            at += n
    for deliver in deliveries:
        deliver()


def _as_tensor(view: memoryview) -> torch.Tensor:
    return torch.frombuffer(view, dtype=torch.uint8) if len(view) else torch.empty(
        0, dtype=torch.uint8)


def exchange(ctx: ShareContext, share: RankShare, backend: Backend,
             mine: dict[UnitKey, list[ItemRead]], delivery: Delivery, *, gap: int,
             max_range: int, key_of: Callable[[str], str] | None = None) -> ExchangeStats:
    """Run this rank's part of the sharing schedule (collective over ``ctx``).

    Args:
        ctx: The load's ranks.
        share: This rank's schedule.
        backend: Where the owned units are fetched from.
        mine: This rank's read requests of the shared units, by key.
        delivery: Lays out and verifies what arrives (see :mod:`dcpstore.dcp.delivery`).
        gap: Coalescing gap of the owned units' range requests.
        max_range: Upper bound of one range request.
        key_of: Maps a unit's path (a ``relative_path``) to its key in ``backend``
            (an incremental checkpoint reads through its run root).

    Raises:
        PeerReadError: Another rank failed (its own error says why).
        IntegrityError, OSError: This rank's fetch or checks failed.
    """
    stats = ExchangeStats()
    error: BaseException | None = None

    def fetch(window: list[SharedUnit]) -> dict[UnitKey, memoryview]:
        pieces = [p for u in window for p in u.pieces]
        owned = [p for p in pieces if p.owner == ctx.rank]
        others = {p.key[:2] for p in pieces if p.owner != ctx.rank}
        return _fetch(backend, owned, others, mine, gap, max_range, stats, key_of)

    # the next window's pieces are fetched while this one is exchanged and delivered
    with ThreadPoolExecutor(1, thread_name_prefix="dcpstore-share") as prefetch:
        ahead = prefetch.submit(fetch, share.windows[0]) if share.windows else None
        try:
            for index, window in enumerate(share.windows):
                current, ahead = ahead, None
                if error is None and index + 1 < len(share.windows):
                    ahead = prefetch.submit(fetch, share.windows[index + 1])
                error = _window(ctx, window, current, mine, delivery, stats, error)
        finally:
            if ahead is not None:
                ahead.cancel()  # or wait for it: the pool's exit joins its thread
    if error is not None:
        raise error
    return stats


def _window(ctx: ShareContext, window: list[SharedUnit],
            fetched: Future[dict[UnitKey, memoryview]] | None,
            mine: dict[UnitKey, list[ItemRead]], delivery: Delivery, stats: ExchangeStats,
            error: BaseException | None) -> BaseException | None:
    """One window: agree that every fetch worked, exchange, deliver. Returns this
    rank's error so far (the others hear of it at the next window's status)."""
    transfers = [(p, u) for u in window for p in u.pieces]
    data: dict[UnitKey, memoryview] = {}
    if error is None and fetched is not None:
        try:
            data = fetched.result()
        except BaseException as exc:
            error = exc
    failed = torch.zeros(ctx.size, dtype=torch.int32)
    failed[ctx.rank] = error is not None
    dist.all_reduce(failed, group=ctx.group)
    if failed.any():
        if error is not None:
            raise error
        ranks = ", ".join(str(r) for r in failed.nonzero().flatten().tolist())
        raise PeerReadError(f"rank(s) {ranks} of this load failed to fetch or check "
                            f"bytes shared with rank {ctx.rank}; see their errors")
    sends: dict[int, list[Piece]] = {}
    recvs: dict[int, list[Piece]] = {}
    for piece, unit in transfers:
        if piece.owner == ctx.rank:
            for peer in unit.needers:
                if peer != ctx.rank:
                    sends.setdefault(peer, []).append(piece)
        elif unit.needed_by(ctx.rank):
            recvs.setdefault(piece.owner, []).append(piece)
    ops: list[dist.P2POp] = []
    messages: dict[tuple[UnitKey, ...], torch.Tensor] = {}  # one copy per content
    for peer, units in sorted(sends.items()):
        content = tuple(u.key for u in units)
        if content not in messages:
            messages[content] = (_as_tensor(data[units[0].key]) if len(units) == 1
                                 else torch.cat([_as_tensor(data[k]) for k in content]))
        message = messages[content]
        stats.bytes_sent += message.numel()
        ops.append(dist.P2POp(dist.isend, message, group=ctx.group, group_peer=peer))
    inbox: list[tuple[list[Piece], torch.Tensor]] = []
    for peer, units in sorted(recvs.items()):
        buf = torch.empty(sum(u.key[2] for u in units), dtype=torch.uint8)
        stats.bytes_received += buf.numel()
        inbox.append((units, buf))
        ops.append(dist.P2POp(dist.irecv, buf, group=ctx.group, group_peer=peer))
    if ops:
        for work in dist.batch_isend_irecv(ops) or ():
            work.wait()
    for pieces, buf in inbox:
        view = buf.numpy().data.cast("B")
        pos = 0
        for piece in pieces:
            data[piece.key] = view[pos : pos + piece.key[2]]
            pos += piece.key[2]
    if error is None:
        try:
            for unit in window:
                if unit.key in mine:
                    _deliver(delivery, unit.key, mine[unit.key],
                             [data[p.key] for p in unit.pieces])
        except BaseException as exc:
            error = exc  # the others hear of it at the next window's status
    return error
