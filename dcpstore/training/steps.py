"""The step listing: which steps are committed, and where (the local tier, the root or
both), agreed by every rank.

The root is asked once, by the coordinator, and the answer is broadcast; a local step
counts only when every rank's local tier holds it.
"""

from __future__ import annotations

import os

from dcpstore.dcp import layout
from dcpstore.training.context import CheckpointerContext
from dcpstore.training.local_tier import Step, local_committed_steps

__all__ = ["StepListing"]


class StepListing:
    """Lists a run's committed steps (every method is collective).

    Args:
        context: The Checkpointer's settings, root and collectives.
    """

    def __init__(self, context: CheckpointerContext) -> None:
        self._config, self._root, self._collectives = (
            context.config, context.root, context.collectives)

    def steps(self) -> list[Step]:
        """Committed steps, oldest first (see :meth:`Checkpointer.steps`)."""
        remote: list[int] = self._collectives.on_coordinator(
            self._root.committed, self._root.failure)
        if self._config.local_tier is None:
            return [Step(s, local=False, remote=True) for s in remote]
        local = self.local_common()
        remote_set = set(remote)
        return [Step(s, local=s in local, remote=s in remote_set)
                for s in sorted(local | remote_set)]

    def latest(self) -> Step | None:
        """The newest step committed anywhere every rank can reach, or ``None`` (see
        :meth:`Checkpointer.latest`)."""
        newest_remote: int | None = self._collectives.on_coordinator(
            self._root.newest, self._root.failure)
        if self._config.local_tier is None:
            return None if newest_remote is None else Step(newest_remote, local=False,
                                                           remote=True)
        local = self.local_common()
        candidates = local | ({newest_remote} if newest_remote is not None else set())
        if not candidates:
            return None
        newest = max(candidates)
        return Step(newest, local=newest in local, remote=newest == newest_remote)

    def local_common(self, only: int | None = None) -> set[int]:
        """Steps committed in every rank's local tier; with ``only``, that step alone
        (its ``.metadata`` checked, no listing)."""
        tier = self._config.local_tier
        assert tier is not None
        if only is None:
            mine = set(local_committed_steps(tier))
        else:
            path = self._config.local_step_path(only)
            assert path is not None
            mine = {only} if os.path.isfile(os.path.join(path, layout.METADATA_KEY)) else set()
        return set.intersection(*self._collectives.all_gather(mine))
