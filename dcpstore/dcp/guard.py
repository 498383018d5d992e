"""The sharding guard: refuse per-rank state saved as plain tensors.

DCP treats a plain ``torch.Tensor`` as *replicated*: every rank is assumed to hold the
same value, one copy is kept, and on load every rank gets that copy. When the tensor is
really per-rank (an optimizer that keeps plain local shards of DTensor parameters, a
manually sharded buffer), the checkpoint silently holds one rank's piece and fails
(or worse, loads wrong values) at another world size. The guard runs on the
coordinator over every rank's local plan, before any byte is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from dcpstore.errors import ShardingError

__all__ = ["LocalPlanSummary", "check_global_plan", "summarize_local_plan"]


@dataclass
class LocalPlanSummary:
    """What the guard needs from one rank's local plan (small, sent to the coordinator).

    Attributes:
        rank: The rank that made the plan.
        plain: Shape of each plain (non-DTensor) tensor item that has a dimension
            (a scalar's shape cannot differ between ranks nor be a shard, so neither
            check needs it; at scale the gather carries one entry per rank and key).
        sharded: Global shape of each DTensor / sharded item whose shard starts at the
            origin (every DTensor has one such shard on some rank, so the coordinator
            learns each global shape once, not once per rank).
    """

    rank: int
    plain: dict[str, tuple[int, ...]] = field(default_factory=dict)
    sharded: dict[str, tuple[int, ...]] = field(default_factory=dict)


def summarize_local_plan(plan: SavePlan, rank: int) -> LocalPlanSummary:
    """Summarize the tensor items of a local plan for :func:`check_global_plan`."""
    summary = LocalPlanSummary(rank)
    for item in plan.items:
        if item.tensor_data is None:
            continue
        size = tuple(item.tensor_data.size)
        if item.type == WriteItemType.TENSOR:
            if size:
                summary.plain[item.index.fqn] = size
        elif item.type == WriteItemType.SHARD and not any(item.tensor_data.chunk.offsets):
            summary.sharded[item.index.fqn] = size
    return summary


def _param_of_state_key(fqn: str) -> str | None:
    """``optim.state.layer.weight.exp_avg`` -> ``layer.weight`` (None if not optimizer state)."""
    _head, sep, rest = fqn.partition(".state.")
    if not sep or "." not in rest:
        return None
    return rest.rsplit(".", 1)[0]


def check_global_plan(summaries: Mapping[int, LocalPlanSummary]) -> None:
    """Raise :class:`ShardingError` when per-rank state is saved as plain tensors.

    Two shapes of the bug are caught:

    1. a plain tensor whose shape differs between ranks;
    2. optimizer state (``*.state.<param>.<name>``) kept as a plain tensor while its
       parameter is a DTensor, with the local shard's shape instead of the global one
       (the FusedAdam-style bug: equal shapes on every rank, wrong on reload).
    """
    shapes: dict[str, dict[int, tuple[int, ...]]] = {}
    sharded: dict[str, tuple[int, ...]] = {}
    for rank, summary in summaries.items():
        for fqn, size in summary.plain.items():
            shapes.setdefault(fqn, {})[rank] = size
        sharded.update(summary.sharded)

    for fqn in sorted(shapes):
        per_rank = shapes[fqn]
        if len(set(per_rank.values())) > 1:
            listing = ", ".join(f"rank {r}: {list(s)}" for r, s in sorted(per_rank.items())[:4])
            raise ShardingError(
                f"{fqn!r} is a plain torch.Tensor with different shapes on different ranks "
                f"({listing}). DCP saves plain tensors as replicated and would keep only one "
                "rank's copy, so the checkpoint could not be loaded back or resharded. Save "
                "per-rank state as a DTensor (FSDP2 / fully_shard and "
                "torch.distributed.checkpoint.state_dict.get_state_dict do this), or give "
                "each rank's tensor its own key."
            )

    if not sharded:
        return
    by_suffix: dict[str, tuple[str, tuple[int, ...]]] = {}
    for fqn, size in sharded.items():
        parts = fqn.split(".")
        for i in range(len(parts)):
            by_suffix.setdefault(".".join(parts[i:]), (fqn, size))
    for fqn in sorted(shapes):
        param = _param_of_state_key(fqn)
        if param is None or param not in by_suffix:
            continue
        size = next(iter(shapes[fqn].values()))
        param_fqn, param_size = by_suffix[param]
        if len(size) == 0 or size == param_size:
            continue  # scalar state ("step") or a full replicated copy: fine
        raise ShardingError(
            f"optimizer state {fqn!r} is a plain tensor of shape {list(size)} while its "
            f"parameter {param_fqn!r} is a DTensor of global shape {list(param_size)}: "
            "each rank would save only its local shard as if it were the whole tensor, "
            "and the checkpoint could not be resharded. Keep optimizer state as DTensors "
            "(use torch.distributed.checkpoint.state_dict.get_state_dict / "
            "dcpstore.AppState, or an optimizer that supports DTensor parameters)."
        )
