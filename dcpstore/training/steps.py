"""The step listing: which steps are committed, and where (the local tier, the root or
both).

:meth:`StepListing.steps` and :meth:`StepListing.latest` are not collective: the rank
that calls them reads the root (and its own view of the local tier) itself, so a user may
call them on any subset of ranks. What every rank must agree on (the step a
:meth:`~dcpstore.Checkpointer.load` reads) comes from the collective
:meth:`StepListing.agreed_latest` and :meth:`StepListing.local_common`, which only
collective calls use.
"""

from __future__ import annotations

import os

from dcpstore.dcp import layout
from dcpstore.training.context import CheckpointerContext
from dcpstore.training.local_tier import Step, local_committed_steps

__all__ = ["StepListing"]


class StepListing:
    """Lists a run's committed steps.

    Args:
        context: The Checkpointer's settings, root and collectives.
    """

    def __init__(self, context: CheckpointerContext) -> None:
        self._config, self._root, self._collectives = (
            context.config, context.root, context.collectives)

    def steps(self) -> list[Step]:
        """Committed steps, oldest first (see :meth:`Checkpointer.steps`); this rank
        reads the store itself (not collective)."""
        remote = self._root.committed()
        if self._config.local_tier is None:
            return [Step(s, local=False, remote=True) for s in remote]
        local = set(local_committed_steps(self._config.local_tier))
        remote_set = set(remote)
        return [Step(s, local=s in local, remote=s in remote_set)
                for s in sorted(local | remote_set)]

    def latest(self) -> Step | None:
        """The newest committed step (see :meth:`Checkpointer.latest`); this rank reads
        the store itself (not collective)."""
        newest_remote = self._root.newest()
        local = (set() if self._config.local_tier is None
                 else set(local_committed_steps(self._config.local_tier)))
        return _newest(newest_remote, local)

    def agreed_latest(self) -> Step | None:
        """:meth:`latest`, the same on every rank (collective): the coordinator reads the
        root and shares the answer (or its failure); a local step counts only when every
        rank's local tier holds it."""
        newest_remote: int | None = self._collectives.on_coordinator(
            self._root.newest, self._root.failure)
        local = set() if self._config.local_tier is None else self.local_common()
        return _newest(newest_remote, local)

    def local_common(self, only: int | None = None) -> set[int]:
        """Steps committed in every rank's local tier; with ``only``, that step alone
        (its ``.metadata`` checked, no listing). Collective."""
        return set.intersection(*self._local_views(only))

    def local_any(self, only: int | None = None) -> set[int]:
        """Steps committed in some rank's local tier (on node-local disks, a host that
        lost its disk lists none; whether the others' copies and replicas make a step
        whole is :func:`~dcpstore.training.host_tier.step_holders`'s answer). Collective."""
        return set.union(*self._local_views(only))

    def _local_views(self, only: int | None) -> list[set[int]]:
        tier = self._config.local_tier
        assert tier is not None
        if only is None:
            mine = set(local_committed_steps(tier))
        else:
            path = self._config.local_step_path(only)
            assert path is not None
            mine = {only} if os.path.isfile(os.path.join(path, layout.METADATA_KEY)) else set()
        return self._collectives.all_gather(mine)


def _newest(newest_remote: int | None, local: set[int]) -> Step | None:
    """The newest of the root's newest step and the local ones, or ``None``."""
    candidates = local | ({newest_remote} if newest_remote is not None else set())
    if not candidates:
        return None
    newest = max(candidates)
    return Step(newest, local=newest in local, remote=newest == newest_remote)
