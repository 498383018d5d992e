"""The stager: snapshots a state dict into one arena reused across saves."""

from __future__ import annotations

import bisect
import copy
import dataclasses
import logging
import threading
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from dcpstore.dcp.staging.arena import _ALIGN, _COPY_FAILED, _Arena, progress_counter
from dcpstore.dcp.staging.options import StagingOptions
from dcpstore.torch_internals import dtensor_like, local_tensor

__all__ = ["StagedState", "Stager"]

logger = logging.getLogger(__name__)


def _is_dtensor(value: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(value, DTensor)


@dataclasses.dataclass
class StagedState:
    """A state dict laid out in a :class:`Stager`'s arena (see :meth:`Stager.prepare`).

    Attributes:
        staged: The staged copy (its tensors are arena slots).
        tensors: The source tensors, in slot order.
    """

    staged: dict[str, Any]
    tensors: list[torch.Tensor]

    @property
    def on_cuda(self) -> bool:
        """Whether any tensor is on a CUDA device (copied on a side stream: a writer may
        read the slots only after :meth:`Stager.synchronize`)."""
        return any(t.device.type == "cuda" for t in self.tensors)


class Stager:
    """Snapshots state dicts into one arena reused across saves.

    Args:
        options: Staging options (see :class:`StagingOptions`).

    Attributes:
        allocations: How many arenas were allocated so far (1 for a run whose state
            keeps its layout).
    """

    def __init__(self, options: StagingOptions | None = None) -> None:
        self.options = options or StagingOptions()
        self.allocations = 0
        self.arena: _Arena | None = None
        self._signature: tuple[Any, ...] | None = None
        self._slots: list[torch.Tensor] = []
        self._offsets: list[int] = []
        self._event: Any = None
        self._stream: Any = None
        self._lock = threading.Lock()
        # slots copied so far (shared arenas only; see prepare)
        self._progress: torch.Tensor | None = None

    def __repr__(self) -> str:
        size = self.arena.size if self.arena else 0
        return f"Stager({self.options}, arena={size} bytes, allocations={self.allocations})"

    @property
    def nbytes(self) -> int:
        """Size of the arena (0 before the first stage)."""
        return self.arena.size if self.arena else 0

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict`` into the arena; return the staged copy.

        ``Stateful`` values are turned into their ``state_dict()`` first, non-tensor
        leaves are deep-copied, tensors (and DTensors' local shards) are copied into
        preallocated slots. With ``use_async_staging`` on CUDA the copies may still be in
        flight: call :meth:`synchronize` before reading the result from another thread.
        """
        pending = self.prepare(state_dict)
        self.copy(pending)
        return pending.staged

    def prepare(self, state_dict: dict[str, Any]) -> StagedState:
        """The first half of :meth:`stage`: lay ``state_dict`` out in the arena (allocated
        on the first call or when the layout changed) and return the staged copy whose
        tensor slots :meth:`copy` fills next.

        In a shared arena a counter tells a background writer how many slots hold their
        values, so it may write the first tensors while the later ones are copied
        (:class:`ProxyWriter` waits on it); until :meth:`copy` the counter is 0.
        """
        with self._lock:
            flat = {k: (v.state_dict() if isinstance(v, Stateful) else v)
                    for k, v in state_dict.items()}
            tensors: list[torch.Tensor] = []
            _collect(flat, tensors)
            signature = tuple((t.dtype, tuple(t.shape)) for t in tensors)
            if signature != self._signature or self.arena is None:
                self._allocate(tensors, signature)
            self._set_copied(0)
            return StagedState(_rebuild(flat, iter(self._slots)), tensors)

    def copy(self, pending: StagedState) -> None:
        """The second half of :meth:`stage`: copy the tensors into their slots.

        Raises:
            Whatever the copy raises; a background writer waiting for the slots then
            fails the save instead of waiting.
        """
        with self._lock:
            try:
                with torch.no_grad():
                    if pending.on_cuda:
                        self._copy_cuda(pending.tensors)
                    else:
                        for i, (slot, src) in enumerate(
                                zip(self._slots, pending.tensors, strict=True)):
                            slot.copy_(src)
                            self._set_copied(i + 1)
            except BaseException:
                self._set_copied(_COPY_FAILED)
                raise

    def slot_index(self, offset: int) -> int | None:
        """Index of the slot holding byte ``offset`` of the arena (``None``: none does)."""
        i = bisect.bisect_right(self._offsets, offset) - 1
        if i < 0 or offset >= self._offsets[i] + self._slots[i].nbytes:
            return None
        return i

    def _set_copied(self, n: int) -> None:
        if self._progress is not None:
            self._progress.fill_(n)

    def synchronize(self) -> None:
        """Wait for device-to-host copies still in flight (async staging)."""
        event, self._event = self._event, None
        if event is not None:
            event.synchronize()
            self._set_copied(len(self._slots))

    def close(self) -> None:
        """Release the arena."""
        self.synchronize()
        self._slots = []
        self._offsets = []
        self._progress = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        self._signature = None

    def _allocate(self, tensors: list[torch.Tensor], signature: tuple[Any, ...]) -> None:
        if self.arena is not None:
            logger.info("staging layout changed; reallocating the staging arena")
            self.close()
        offsets, size = [], 0
        for t in tensors:
            offsets.append(size)
            nbytes = t.numel() * t.element_size()
            size += -(-nbytes // _ALIGN) * _ALIGN
        shared = self.options.use_shared_memory
        self.arena = _Arena(size + (_ALIGN if shared else 0), shared=shared,
                            pinned=self.options.use_pinned_memory)
        self._slots = [self.arena.tensor(off, t.dtype, tuple(t.shape))
                       for off, t in zip(offsets, tensors, strict=True)]
        self._offsets = offsets
        self._progress = progress_counter(self.arena) if shared else None
        self._signature = signature
        self.allocations += 1
        logger.debug("allocated a %d-byte staging arena for %d tensors", size, len(tensors))

    def _copy_cuda(self, tensors: list[torch.Tensor]) -> None:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        stream = self._stream
        current = torch.cuda.current_stream()
        stream.wait_stream(current)  # copy the values as of now
        non_blocking = self.options.use_non_blocking_copy and bool(
            self.arena is not None and self.arena.pinned)
        with torch.cuda.stream(stream):
            for slot, src in zip(self._slots, tensors, strict=True):
                if src.device.type == "cuda":
                    src.record_stream(stream)
                slot.copy_(src, non_blocking=non_blocking)
        event = stream.record_event()
        if self.options.use_async_staging:
            current.wait_event(event)  # later in-place updates run after the copies
            self._event = event
        else:
            event.synchronize()
            self._set_copied(len(self._slots))


def _local(t: torch.Tensor) -> torch.Tensor:
    return local_tensor(t)


def _collect(value: Any, out: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        out.append(_local(value))
    elif isinstance(value, Mapping):
        for v in value.values():
            _collect(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect(v, out)


def _rebuild(value: Any, slots: Any) -> Any:
    if isinstance(value, torch.Tensor):
        slot = next(slots)
        return dtensor_like(slot, value) if _is_dtensor(value) else slot
    if isinstance(value, Mapping):
        return {k: _rebuild(v, slots) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_rebuild(v, slots) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_rebuild(v, slots) for v in value)
    return copy.deepcopy(value)
