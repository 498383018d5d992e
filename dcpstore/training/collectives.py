"""The Checkpointer's collectives: the coordinator's answers broadcast to every rank, a
coordinator-only store call's outcome (result or failure) shared with every rank, and
the gloo groups of its background work.

Outside ``torch.distributed`` every call is local (one rank, the coordinator).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import torch.distributed as dist

from dcpstore.dcp.dist import is_distributed
from dcpstore.errors import decode_error, encode_error
from dcpstore.torch_internals import group_timeout

__all__ = ["Collectives"]

T = TypeVar("T")


class Collectives:
    """Collectives over one process group.

    Every method takes an optional ``group``; ``None`` means :attr:`group`.

    Args:
        group: The process group of the Checkpointer's own collectives (``None``: the
            global group).
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self._side: dict[str, Any] = {}
        self._lock = threading.Lock()

    def side_group(self, job: Literal["async", "drain"]) -> Any:
        """The gloo group of background ``job``, made on first use (``None`` without
        ``torch.distributed``).

        Making it is a collective of the Checkpointer's group (the world's, without
        one): call it from the training thread on every rank of it in the same order,
        before the background thread uses the group.
        """
        if not is_distributed():
            return None
        with self._lock:
            if job not in self._side:
                # a group of its own keeps background collectives off the training group;
                # with the training group's timeout (a dead peer host fails it as soon)
                timeout = group_timeout(self.group)
                if self.group is None:
                    self._side[job] = dist.new_group(backend="gloo", timeout=timeout)
                else:  # the same ranks; made by them alone (other jobs may share the world)
                    self._side[job] = dist.new_group(
                        dist.get_process_group_ranks(self.group), backend="gloo",
                        timeout=timeout, use_local_synchronization=True)
        return self._side[job]

    def rank(self, group: Any = None) -> int:
        """This process's rank in ``group``."""
        if not is_distributed():
            return 0
        return int(dist.get_rank(self._or_default(group)))

    def is_coordinator(self, group: Any = None) -> bool:
        """Whether this process is rank 0 of ``group``."""
        return self.rank(group) == 0

    def broadcast(self, value: Any, group: Any = None, src: int = 0) -> Any:
        """Rank ``src``'s ``value`` (a rank of ``group``), on every rank."""
        if not is_distributed():
            return value
        group = self._or_default(group)
        box = [value]
        root = dist.get_global_rank(group, src) if group is not None else src
        dist.broadcast_object_list(box, src=root, group=group)
        return box[0]

    def all_gather(self, value: Any, group: Any = None) -> list[Any]:
        """Every rank's ``value``, in rank order, on every rank."""
        if not is_distributed():
            return [value]
        group = self._or_default(group)
        out: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, value, group=group)
        return out

    def barrier(self, group: Any = None) -> None:
        """Wait until every rank of ``group`` is here."""
        if is_distributed():
            dist.barrier(group=self._or_default(group))

    def on_coordinator(self, fn: Callable[[], T], failure: str, group: Any = None) -> T:
        """``fn()`` run on the coordinator alone; its result on every rank, or its
        failure raised on every rank (see :meth:`share`)."""
        return self.share(fn if self.is_coordinator(group) else None, failure, group)

    def share(self, fn: Callable[[], T] | None, failure: str, group: Any = None) -> T:
        """Share the outcome of a call that one rank makes (rank 0: ``fn`` is ``None``
        everywhere else) with every rank.

        No rank is left waiting in a collective: the rank that ran ``fn`` raises its
        error, every other rank the same kind of error (class, ``errno`` and request id
        kept: :func:`~dcpstore.errors.decode_error`), its message prefixed by
        ``failure``.
        """
        answer: tuple[str, Any] | None = None
        error: BaseException | None = None
        if fn is not None:
            try:
                answer = ("ok", fn())
            except BaseException as exc:
                error = exc
                answer = ("err", encode_error(exc))
        answer = self.broadcast(answer, group)
        assert answer is not None
        if answer[0] == "ok":
            return answer[1]
        if error is not None:
            raise error
        raise decode_error(answer[1], f" ({failure}; see the coordinator's log)")

    def agree(self, fn: Callable[[], T], failure: str, group: Any = None) -> T:
        """``fn()`` run on every rank; its result where it succeeded on every rank.

        Where it failed on any rank, every rank raises: a failed rank its own error, the
        others the first failed rank's kind of error (see :meth:`share`), its message
        naming the failed ranks after ``failure``. So no rank goes on into a collective
        that a failed rank will never join.
        """
        result: Any = None
        error: BaseException | None = None
        outcome: bytes | None = None
        try:
            result = fn()
        except BaseException as exc:
            error, outcome = exc, encode_error(exc)
        outcomes = self.all_gather(outcome, group)
        failed = [rank for rank, o in enumerate(outcomes) if o is not None]
        if not failed:
            return result
        if error is not None:
            raise error
        raise decode_error(outcomes[failed[0]],
                           f" ({failure} on rank(s) {failed}; see their logs)")

    def _or_default(self, group: Any) -> Any:
        return self.group if group is None else group
