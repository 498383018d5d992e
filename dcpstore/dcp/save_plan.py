"""The save plan between the coordinator and the ranks: what each rank's global plan
carries (:class:`_Assignment`), the sharding guard's input, and torch's save-plan caching
(``DefaultSavePlanner(enable_plan_caching=True)``), under which a rank writes the plan it
cached yet must use the fresh id of this save (:class:`_FreshSaveId`)."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType

from dcpstore import errors
from dcpstore.dcp.guard import LocalPlanSummary
from dcpstore.dcp.incremental import _BaseItem, _chunk_key, _ChunkKey

__all__: list[str] = []

logger = logging.getLogger(__name__)


@dataclass
class _Assignment:
    """What the coordinator sends each rank in its global plan."""

    rank: int
    save_id: str
    #: Chunks of this rank's plan that the base holds (incremental saves).
    base: dict[_ChunkKey, _BaseItem] = dataclasses.field(default_factory=dict)


class _FreshSaveId:
    """The save id of this save, sent in the (otherwise empty) global plan of a save
    whose plan torch took from its plan cache.

    On a cache hit DCP still scatters the coordinator's global plan, but each rank then
    writes the plan it cached (with the save id of the save that filled the cache).
    Unpickling this object on the receiving rank notes the fresh id for the thread that
    runs the save; :meth:`Writer.write_data` replaces the cached plan's id with it.
    """

    def __init__(self, save_id: str) -> None:
        self.save_id = save_id

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return _received_save_id, (self.save_id,)

    def __repr__(self) -> str:
        return f"_FreshSaveId({self.save_id!r})"


_pending = threading.local()


def _received_save_id(save_id: str) -> _FreshSaveId:
    """Unpickling hook of :class:`_FreshSaveId`: note ``save_id`` for this thread."""
    _pending.save_id = save_id
    return _FreshSaveId(save_id)


def _take_pending_save_id() -> str | None:
    save_id: str | None = getattr(_pending, "save_id", None)
    _pending.save_id = None
    return save_id


def _summary(plan: SavePlan, rank: int) -> LocalPlanSummary:
    data = plan.storage_data
    return data if isinstance(data, LocalPlanSummary) else LocalPlanSummary(rank)


def _guard_input(plans: Sequence[SavePlan]) -> dict[int, LocalPlanSummary] | None:
    """Every rank's local-plan summary for the sharding guard; ``None`` when torch's
    plan cache found no local plan changed (those plans passed the guard when cached:
    torch caches a rank's local plan only once the global plan was accepted).

    With some plans changed, torch hands the storage writer only the global plans that
    changed, so a rank whose change was deduplicated away (a plain tensor saved by
    another rank: what the guard is for) arrives as an empty plan. The summaries of
    every rank are then those of the local plans torch merged for this save.
    """
    if all(p.usable for p in plans):
        return {i: _summary(p, i) for i, p in enumerate(plans)}
    if not any(p.usable for p in plans):
        return None
    changed = [i for i, p in enumerate(plans) if p.usable]
    cache = getattr(SavePlanner, "_cached_all_plans", None)
    for merged in (cache or {}).values():
        if len(merged) == len(plans) and all(
                merged[i].storage_data is plans[i].storage_data
                or merged[i].storage_data == plans[i].storage_data for i in changed):
            return {i: _summary(p, i) for i, p in enumerate(merged)}
    logger.warning("torch's merged local plans were not found; the sharding guard checks "
                   "only the %d changed plans", len(changed))
    return {i: _summary(plans[i], i) for i in changed}


def _global_plans(plans: Sequence[SavePlan], *, save_id: str, rank: int,
                  known: dict[_ChunkKey, _BaseItem]) -> list[SavePlan]:
    """Every rank's global plan: its :class:`_Assignment` (with the chunks of ``known``,
    the base of an incremental save, that its plan saves), or, for a plan torch took
    from its cache (``usable=False``), this save's fresh id (:class:`_FreshSaveId`)."""
    out = []
    for i, plan in enumerate(plans):
        if plan.usable:
            out.append(dataclasses.replace(plan, storage_data=_Assignment(
                rank=i, save_id=save_id,
                base={key: known[key] for key in (
                    _chunk_key(item.index.fqn, item.index.offset) for item in plan.items
                    if item.type != WriteItemType.BYTE_IO) if key in known})))
        else:
            out.append(dataclasses.replace(plan, storage_data=_FreshSaveId(save_id)))
    if not plans[rank if rank < len(plans) else 0].usable:
        _pending.save_id = save_id  # this rank may get its plan without a pickle
    return out


def _assignment_of(plan: SavePlan) -> _Assignment:
    """This rank's assignment for this save: the plan's own, or, for a plan torch took
    from its cache, its rank with the save id the coordinator just sent."""
    assignment = plan.storage_data
    if not isinstance(assignment, _Assignment):
        raise errors.DcpstoreError(
            "the global plan carries no dcpstore assignment; was prepare_global_plan "
            "skipped, or the plan made for another storage writer?"
        )
    fresh = _take_pending_save_id()
    if fresh is not None and fresh != assignment.save_id:
        logger.debug("cached save plan: save id %s replaces %s", fresh,
                     assignment.save_id)
        assignment = _Assignment(rank=assignment.rank, save_id=fresh)
    return assignment
