"""Small helpers around ``torch.distributed`` and DCP shared by the API, the
:class:`~dcpstore.Checkpointer`, weight export and the integrations."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from dcpstore.errors import DcpstoreError

__all__ = ["UNSET", "is_distributed", "single_process_quiet", "unwrap"]


class _Unset:
    """The type of :data:`UNSET`."""

    def __repr__(self) -> str:
        return "UNSET"

    def __reduce__(self) -> str:  # one object in every process
        return "UNSET"


#: A ``process_group`` argument not given (``None`` means the world).
UNSET: Any = _Unset()


def is_distributed() -> bool:
    """Whether ``torch.distributed`` is available and a process group is initialized."""
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """Silence DCP's warning that it runs in one process: here that is deliberate."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def unwrap(exc: CheckpointException) -> BaseException:
    """The most useful error inside DCP's ``CheckpointException``.

    A dcpstore error first, then an ``OSError``, then whatever a rank raised; annotated
    with the rank. Returns ``exc`` itself when no rank's failure is an exception.
    """
    failures = [
        (rank, f[0] if isinstance(f, tuple) else f) for rank, f in exc.failures.items()
    ]
    for kind in (DcpstoreError, OSError, Exception):
        for rank, err in failures:
            if isinstance(err, kind):
                if hasattr(err, "add_note"):
                    err.add_note(f"(raised on rank {rank} during {exc.args[0]!r}; "
                                 f"{len(failures)} rank(s) failed)")
                return err
    return exc
