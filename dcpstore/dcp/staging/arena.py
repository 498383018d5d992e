"""The staging arena: one memory mapping (shared memory for a background process,
page-locked for CUDA copies) that holds every staged tensor, and its copy-progress
counter."""

from __future__ import annotations

import contextlib
import logging
import mmap
import os

import torch

__all__ = ["progress_counter"]

logger = logging.getLogger(__name__)

_ALIGN = 64
#: The progress counter's value after a failed copy.
_COPY_FAILED = -1


class _Arena:
    """One mapping holding every staged tensor; each tensor gets its own storage."""

    def __init__(self, size: int, *, shared: bool, pinned: bool) -> None:
        self.size = max(size, _ALIGN)
        self.fd: int | None = None
        if shared:
            self.fd = os.memfd_create("dcpstore-staging", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, self.size)
            self.mm = mmap.mmap(self.fd, self.size)
        else:
            self.mm = mmap.mmap(-1, self.size)
        self.view = memoryview(self.mm)
        whole = torch.frombuffer(self.view, dtype=torch.uint8)
        whole.zero_()  # fault the pages in now, not during the first copy
        self.base = whole.data_ptr()
        self.pinned = False
        if pinned and torch.cuda.is_available():
            rc = torch.cuda.cudart().cudaHostRegister(self.base, self.size, 0)
            self.pinned = int(getattr(rc, "value", rc)) == 0
            if not self.pinned:
                logger.warning("could not pin the %d-byte staging arena (cudaHostRegister "
                               "returned %s); device copies will be synchronous", self.size, rc)
        del whole

    def tensor(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor over ``[offset, offset + nbytes)`` with a storage of exactly that size
        (the writer would otherwise copy a view of a larger storage)."""
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self.view[offset: offset + nbytes], dtype=dtype).view(shape)

    def locate(self, t: torch.Tensor) -> int | None:
        """Offset of ``t`` in the arena when ``t`` is a whole contiguous slot of it."""
        if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
            return None
        ptr = t.data_ptr()
        if self.base <= ptr and ptr + t.nbytes <= self.base + self.size:
            return ptr - self.base
        return None

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.base)
            self.pinned = False
        # staged tensors still alive keep the mapping; it goes with them
        with contextlib.suppress(BufferError):
            self.view.release()
            self.mm.close()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def progress_counter(arena: _Arena) -> torch.Tensor:
    """The shared arena's copy-progress counter: its last 8 bytes, one int64 (slots copied
    so far, or -1 after a failed copy)."""
    return arena.tensor(arena.size - 8, torch.int64, (1,))
