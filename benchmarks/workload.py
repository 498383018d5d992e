"""The benchmark's state dict: float32 DTensor ``Shard(0)`` shards on a 1-D device mesh.

Every system saves and loads exactly the same state: the tensor shapes follow from a
:class:`WorkloadSpec` (total size, tensor count, size mix) alone, and every element's
value is a pure function of (tensor, global element index, seed), so a rank can build
its local shards -- or the shards it *should* have loaded at another world size --
without any communication, and a load is checked bit-exact with one ``memcmp`` per
tensor against the expected shards.

Values are finite floats in +-[1, 2) (no NaN: nothing downstream ever needs to think
about NaN payloads), different at every position of every tensor, so a misplaced, shifted
or torn range is caught.

A rank holds its shards twice by default: the source it saves and a separate destination
it loads into. With ``RankState(..., in_place=True)`` (the scaling curves' large states)
it holds them once: a load goes into the source tensors, zeroed first, and is checked
against values regenerated chunk by chunk from the pure function, so the check needs
:data:`VERIFY_CHUNK_BYTES` of scratch instead of a second copy of the state.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

__all__ = [
    "MIXES",
    "VERIFY_CHUNK_BYTES",
    "RankState",
    "TensorPlan",
    "WorkloadSpec",
    "format_bytes",
    "parse_size",
    "plan_tensors",
]

logger = logging.getLogger(__name__)

#: Size mixes: ``equal`` (every tensor the same size) and ``mixed`` (an LLM-like mix:
#: one large embedding, matrices of varied sizes, a quarter small 1-D vectors).
MIXES = ("mixed", "equal")

_COLS = 1024  # elements per row of the 2-D tensors (4 KiB of float32)
_ELEM = 4  # bytes per float32
#: Scratch a rank allocates to check an in-place load (values regenerated per chunk).
VERIFY_CHUNK_BYTES = 16 << 20

_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10,
               "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
               "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
               "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """``"1GiB"``, ``"64MiB"``, ``"512M"``, ``"1048576"`` -> bytes (binary multiples).

    Raises:
        ValueError: Not a size.
    """
    t = text.strip().lower().replace("_", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    if not num or unit not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 64MiB, 1GiB)")
    value = int(float(num) * _SIZE_UNITS[unit])
    if value <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return value


def format_bytes(n: float) -> str:
    """Binary-multiple rendering: ``1.0 GiB``, ``64 MiB``, ``512 B``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class WorkloadSpec:
    """What state dict to build.

    Attributes:
        total_bytes: Requested total size; the real size (:func:`plan_tensors`) is within
            a few rows of it.
        tensors: Number of tensors.
        mix: One of :data:`MIXES`.
        seed: Changes every value (not the shapes).
    """

    total_bytes: int
    tensors: int = 32
    mix: str = "mixed"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mix not in MIXES:
            raise ValueError(f"mix must be one of {', '.join(MIXES)}, got {self.mix!r}")
        if self.tensors < 1:
            raise ValueError(f"tensors must be >= 1, got {self.tensors}")
        if self.total_bytes < self.tensors * _COLS * _ELEM:
            raise ValueError(
                f"{format_bytes(self.total_bytes)} is too small for {self.tensors} tensors "
                f"(at least {format_bytes(self.tensors * _COLS * _ELEM)})"
            )

    @property
    def state_bytes(self) -> int:
        """Exact size of the state dict (sum of all tensors)."""
        return sum(t.nbytes for t in plan_tensors(self))

    def describe(self) -> str:
        """One line: size, tensor count, mix."""
        return (f"{format_bytes(self.state_bytes)} in {self.tensors} float32 DTensors "
                f"({self.mix} sizes)")


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of the state dict.

    Attributes:
        index: Position (also salts the values).
        name: State-dict key.
        shape: Global shape (dimension 0 is sharded).
    """

    index: int
    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Elements of the global tensor."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Bytes of the global tensor."""
        return self.numel * _ELEM


def plan_tensors(spec: WorkloadSpec) -> list[TensorPlan]:
    """The tensors of a workload, largest-first within each group (deterministic)."""
    row = _COLS * _ELEM
    plans: list[TensorPlan] = []
    if spec.mix == "equal":
        rows = max(1, spec.total_bytes // (spec.tensors * row))
        for i in range(spec.tensors):
            plans.append(TensorPlan(i, f"model.layers.{i}.weight", (rows, _COLS)))
        return plans
    # mixed: 1/4 small vectors, one embedding of ~1/8 of the bytes, the rest matrices of
    # varied sizes; odd row counts, so Shard(0) splits them unevenly at even world sizes
    n_small = spec.tensors // 4
    n_big = spec.tensors - n_small
    small_sizes = [1024, 4096, 16384]  # elements
    small = [small_sizes[i % len(small_sizes)] for i in range(n_small)]
    remaining = spec.total_bytes - sum(small) * _ELEM
    embed_rows = (max(1, remaining // 8 // row) | 1) if n_big > 1 else max(1, remaining // row)
    plans.append(TensorPlan(0, "model.embed.weight", (embed_rows, _COLS)))
    remaining -= embed_rows * row
    weights = [(1.0, 1.0, 2.5, 0.5)[i % 4] for i in range(n_big - 1)]
    total_w = sum(weights) or 1.0
    for i, w in enumerate(weights):
        rows = max(1, int(remaining * w / total_w) // row) | 1
        plans.append(TensorPlan(len(plans), f"model.layers.{i}.weight", (rows, _COLS)))
    for i, n in enumerate(small):
        plans.append(TensorPlan(len(plans), f"model.layers.{i}.norm", (n,)))
    return plans


_BLOCK = 1 << 20  # elements per block of the value pattern
_BASES: dict[int, Any] = {}


def _base(seed: int) -> Any:
    """A fixed pseudo-random uint32 block (one per seed, cached)."""
    import numpy as np

    if seed not in _BASES:
        _BASES[seed] = np.random.Generator(np.random.PCG64(seed)).integers(
            0, 1 << 32, _BLOCK, dtype=np.uint32)
    return _BASES[seed]


def _block_key(block: int, salt: int) -> int:
    """A 32-bit hash of (block number, tensor salt) (splitmix64's finalizer)."""
    x = (block * 0x9E3779B97F4A7C15 + salt * 0xBF58476D1CE4E5B9 + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & 0xFFFFFFFF


def _fill(out: torch.Tensor, start: int, salt: int, seed: int) -> None:
    """Write the values of global flat elements ``start .. start + out.numel()`` into
    ``out`` (a contiguous float32 tensor).

    Element ``g`` is ``base[g % B] ^ key(g // B, salt)``, masked to a finite float in
    +-[1, 2): every position of every tensor gets its own value, at numpy speed.
    """
    import numpy as np

    flat = out.view(-1).numpy().view(np.uint32)
    base = _base(seed)
    n = flat.size
    pos = 0
    while pos < n:
        g = start + pos
        block, j = divmod(g, _BLOCK)
        take = min(_BLOCK - j, n - pos)
        dst = flat[pos:pos + take]
        np.bitwise_xor(base[j:j + take], np.uint32(_block_key(block, salt)), out=dst)
        np.bitwise_and(dst, np.uint32(0x807FFFFF), out=dst)
        np.bitwise_or(dst, np.uint32(0x3F800000), out=dst)
        pos += take


def _matches_values(t: torch.Tensor, start: int, salt: int, seed: int) -> bool:
    """Whether contiguous float32 ``t`` holds exactly the values of global flat elements
    ``start ..`` (bit-exact), regenerating them :data:`VERIFY_CHUNK_BYTES` at a time."""
    flat = t.view(-1).view(torch.int32)
    n = flat.numel()
    step = VERIFY_CHUNK_BYTES // _ELEM
    scratch = torch.empty(min(step, n), dtype=torch.float32)
    for lo in range(0, n, step):
        take = min(step, n - lo)
        want = scratch[:take]
        _fill(want, start + lo, salt, seed)
        if not torch.equal(flat[lo:lo + take], want.view(torch.int32)):
            return False
    return True


@dataclass
class _Shard:
    plan: TensorPlan
    local_shape: tuple[int, ...]
    offset: tuple[int, ...]

    @property
    def start(self) -> int:
        """Global flat index of the shard's first element (Shard(0): rows are contiguous)."""
        row = self.plan.numel // self.plan.shape[0] if self.plan.shape[0] else 0
        return self.offset[0] * row

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.local_shape:
            n *= d
        return n * _ELEM


@dataclass
class RankState:
    """One rank's view of a workload at one world size: expected shards, a destination
    to load into, and the checks.

    Args:
        spec: The workload.
        mesh: The 1-D CPU device mesh of this world size.
        in_place: Load into the source tensors (zeroed first) rather than into a second
            copy, and check a load against values regenerated chunk by chunk: the rank
            holds its share once, not twice. A source that a load has overwritten is
            made whole again by :meth:`verify` (or by :meth:`source`, if the load failed
            before it could be checked), so every save still saves the expected values.
    """

    spec: WorkloadSpec
    mesh: DeviceMesh
    in_place: bool = False
    _shards: list[_Shard] = field(init=False)
    _expected: dict[str, torch.Tensor] | None = field(default=None, init=False)
    _destination: dict[str, torch.Tensor] | None = field(default=None, init=False)
    #: Whether the source tensors hold the expected values (``False`` while an in-place
    #: load's destination is not yet checked).
    _source_valid: bool = field(default=True, init=False)
    #: In place: whether a destination was handed out, and the last check's verdict.
    _loaded: bool = field(default=False, init=False)
    _load_ok: bool = field(default=False, init=False)
    #: Per-system caches that live as long as the state (e.g. the limits' buffers).
    scratch: dict[str, Any] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self._shards = []
        for plan in plan_tensors(self.spec):
            shape, offset = compute_local_shape_and_global_offset(
                plan.shape, self.mesh, [Shard(0)])
            self._shards.append(_Shard(plan, tuple(shape), tuple(offset)))

    @property
    def share_bytes(self) -> int:
        """Bytes of this rank's local shards."""
        return sum(s.nbytes for s in self._shards)

    @property
    def largest_local_bytes(self) -> int:
        """Bytes of this rank's largest local shard."""
        return max((s.nbytes for s in self._shards), default=0)

    def _expected_locals(self) -> dict[str, torch.Tensor]:
        if self._expected is None:
            expected = {}
            for s in self._shards:
                t = torch.empty(s.local_shape, dtype=torch.float32)
                _fill(t, s.start, s.plan.index, self.spec.seed)
                expected[s.plan.name] = t
            self._expected = expected
            self._source_valid = True
        return self._expected

    def _restore(self) -> None:
        """Write the expected values into the source tensors again."""
        tensors = self._expected_locals()
        for s in self._shards:
            _fill(tensors[s.plan.name], s.start, s.plan.index, self.spec.seed)
        self._source_valid = True

    def _wrap(self, locals_: dict[str, torch.Tensor]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for s in self._shards:
            t = locals_[s.plan.name]
            out[s.plan.name] = DTensor.from_local(
                t, self.mesh, [Shard(0)], run_check=False, shape=torch.Size(s.plan.shape),
                stride=_contiguous_stride(s.plan.shape))
        return out

    def _valid_source(self) -> dict[str, torch.Tensor]:
        tensors = self._expected_locals()
        if not self._source_valid:
            logger.warning("the last in-place load was not checked: restoring the source")
            self._restore()
        return tensors

    def source(self) -> dict[str, Any]:
        """The state dict to save: DTensors over this rank's expected shards (cached;
        savers never modify it)."""
        return self._wrap(self._valid_source())

    def destination(self) -> dict[str, Any]:
        """A zeroed state dict of the same structure to load into (its pages touched
        now, so the memory a load adds is what the load itself allocates). In place:
        the source tensors, zeroed."""
        if self.in_place:
            tensors = self._expected_locals()
            self._source_valid = False
            self._loaded = True
            for t in tensors.values():
                t.zero_()
            return self._wrap(tensors)
        if self._destination is None:
            self._destination = {s.plan.name: torch.empty(s.local_shape, dtype=torch.float32)
                                 for s in self._shards}
        for t in self._destination.values():
            t.zero_()
        return self._wrap(self._destination)

    def local_views(self, which: str = "source") -> list[memoryview]:
        """Byte views of the local shards in plan order (``"source"`` or
        ``"destination"``), for the raw-I/O limits."""
        tensors: dict[str, torch.Tensor] | None
        if which == "source":
            tensors = self._valid_source()
        elif self.in_place:
            if self._source_valid:
                self.destination()
            tensors = self._expected_locals()
        else:
            tensors = self._destination
            if tensors is None:
                self.destination()
                tensors = self._destination
        assert tensors is not None
        return [_byte_view(tensors[s.plan.name]) for s in self._shards]

    def concat(self) -> bytearray:
        """This rank's shards back to back: what the raw limits move. A new buffer each
        call, not kept: at 4 GiB a cached copy was 2 GiB more per rank, and two ranks
        with SeaweedFS no longer fitted in 23 GiB. Callers keep what they need."""
        buf = bytearray(self.share_bytes)
        pos = 0
        for view in self.local_views("source"):
            buf[pos:pos + len(view)] = view
            pos += len(view)
        return buf

    def release_destination(self) -> None:
        """Free the load destination (the stall suite's large states need the memory)."""
        self._destination = None

    def verify(self) -> bool:
        """Whether the destination holds exactly the expected bytes (bit-exact).

        In place, each tensor is compared with values regenerated chunk by chunk; the
        source is then whole again (restored if the load was wrong)."""
        if self.in_place:
            if self._expected is None or not self._loaded:
                return False  # nothing was loaded
            if self._source_valid:
                return self._load_ok  # checked already
            ok = True
            for s in self._shards:
                if not _matches_values(self._expected[s.plan.name], s.start, s.plan.index,
                                       self.spec.seed):
                    logger.error("%s: loaded bytes differ from the saved ones", s.plan.name)
                    ok = False
                    break
            self._load_ok = ok
            if ok:
                self._source_valid = True
            else:
                self._restore()
            return ok
        if self._destination is None:
            return False
        expected = self._expected_locals()
        for name, t in self._destination.items():
            e = expected[name]
            if t.shape != e.shape or not torch.equal(t.view(torch.int32), e.view(torch.int32)):
                logger.error("%s: loaded bytes differ from the saved ones", name)
                return False
        return True

    def iter_sizes(self) -> Iterator[int]:
        """Bytes of each local shard, in plan order."""
        for s in self._shards:
            yield s.nbytes


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride = []
    acc = 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))


def _byte_view(t: torch.Tensor) -> memoryview:
    if t.numel() == 0:
        return memoryview(b"")
    array: Any = t.view(-1).view(torch.uint8).numpy()
    return memoryview(array).cast("B")
