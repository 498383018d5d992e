"""Runs the plan: every system's save and load on every store, interleaved, then the
untimed request-counting runs, and collects what the ranks measured.

Order within a store (``--runs 3``, systems A B C)::

    run 1: A.save A.load [A.load@M ...]  B.save B.load ...  C.save C.load ...
    run 2: B ... C ... A ...
    run 3: C ... A ... B ...
    counting (one run, through the proxy): A.save A.load [A.load@M]  B ...  C ...

Interleaving spreads slow drifts of the machine over every system; rotating the order
keeps any system from always going first (say, onto a store whose disk has just been
flushed) or always following the same neighbour.

Every save goes to a fresh prefix, the loads (at the save's world size, then at each
reshard world size) read that checkpoint, and the prefix is deleted before the next
system runs, so no system reads what another wrote and the stores do not fill up.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .ranks import Job, JobError, RankPool, RankResult
from .servers import STORE_KINDS, StoreInfo, Stores
from .systems import get as get_system
from .workload import WorkloadSpec, format_bytes

__all__ = ["Case", "Runner", "StorePlan", "rotated"]

logger = logging.getLogger(__name__)


@dataclass
class StorePlan:
    """What to run on one store.

    Attributes:
        name: Store name.
        workload: The state dict.
        systems: System labels in interleaving order (limit variants included).
        reshard: World sizes the DCP systems' checkpoints are also loaded at.
        note: Caveat printed with the store (e.g. "in-memory server, smaller state").
        skipped: ``system -> reason`` for systems that cannot run here.
    """

    name: str
    workload: WorkloadSpec
    systems: list[str]
    reshard: list[int] = field(default_factory=list)
    note: str = ""
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        """``local``, ``s3`` or ``gcs``."""
        return STORE_KINDS[self.name]


@dataclass
class Case:
    """All measurements of one (store, system, op, world size).

    Attributes:
        store: Store name.
        system: System label.
        op: ``"save"`` or ``"load"``.
        world_size: Ranks doing the operation.
        saved_at: World size the checkpoint was saved at (loads; equals
            ``world_size`` unless this is a reshard load).
        state_bytes: Bytes of the state dict.
        runs: One list of per-rank results (dicts) per timed run.
        counted: Figures of the untimed counting run: ``requests`` (by kind),
            ``bytes_up``, ``bytes_down``, ``rchar``, per-rank results.
        errors: Why runs failed.
    """

    store: str
    system: str
    op: str
    world_size: int
    saved_at: int
    state_bytes: int
    runs: list[list[dict[str, Any]]] = field(default_factory=list)
    counted: dict[str, Any] | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def key(self) -> tuple[str, str, str, int]:
        """(store, system, op, world size)."""
        return (self.store, self.system, self.op, self.world_size)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (raw measurements; the report adds the summaries)."""
        return {"store": self.store, "system": self.system, "op": self.op,
                "world_size": self.world_size, "saved_at": self.saved_at,
                "state_bytes": self.state_bytes, "runs": self.runs, "counted": self.counted,
                "errors": self.errors}


class Runner:
    """Execute :class:`StorePlan` s with the rank pools and stores given.

    Args:
        stores: The running stores.
        pools: Rank pools by world size (created lazily by ``pool_factory``).
        pool_factory: Creates the pool of a world size.
        world_size: The save world size.
        runs: Timed repetitions.
        count_requests: Do the untimed counting runs.
        evict_cache: Drop the page cache of local checkpoints before loading them.
        options: ``system label -> options`` (``--opt``).
        job_timeout: Seconds a job may take, as a function of the state size.
        progress: Called with one line per finished job.
    """

    def __init__(self, stores: Stores, pools: dict[int, RankPool],
                 pool_factory: Callable[[int], RankPool], *, world_size: int, runs: int,
                 count_requests: bool, evict_cache: bool,
                 options: Callable[[str], dict[str, Any]],
                 job_timeout: Callable[[int], float],
                 progress: Callable[[str], None] = print) -> None:
        self.stores = stores
        self.pools = pools
        self.pool_factory = pool_factory
        self.world_size = world_size
        self.runs = runs
        self.count_requests = count_requests
        self.evict_cache = evict_cache
        self.options = options
        self.job_timeout = job_timeout
        self.progress = progress
        self.cases: dict[tuple[str, str, str, int], Case] = {}
        self.run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]
        self.jobs_done = 0
        self.jobs_total = 0

    def _pool(self, world_size: int) -> RankPool:
        if world_size not in self.pools:
            self.pools[world_size] = self.pool_factory(world_size)
        return self.pools[world_size]

    def _case(self, plan: StorePlan, system: str, op: str, world_size: int) -> Case:
        key = (plan.name, system, op, world_size)
        if key not in self.cases:
            self.cases[key] = Case(plan.name, system, op, world_size, self.world_size,
                                   plan.workload.state_bytes)
        return self.cases[key]

    @staticmethod
    def count_jobs(plans: list[StorePlan], runs: int, count_requests: bool) -> int:
        """Jobs a run of ``plans`` will do (for the progress counter)."""
        total = 0
        for plan in plans:
            counting = count_requests and plan.kind != "local"
            for system in plan.systems:
                target = get_system(system)
                reshard = 0 if target.is_limit else len(plan.reshard)
                total += (2 + reshard) * runs
                if counting:
                    total += 2 + (0 if target.is_dcpstore else reshard)
        return total

    def run(self, plans: list[StorePlan]) -> list[Case]:
        """Run every plan; return the cases (failed runs are recorded, not raised)."""
        self.jobs_total = self.count_jobs(plans, self.runs, self.count_requests)
        for plan in plans:
            store = self.stores.info[plan.name]
            for rep in range(self.runs):
                for system in rotated(plan.systems, rep):
                    self._one(plan, store, system, rep, counted=False)
            if self.count_requests and store.proxy_url is not None:
                for system in plan.systems:
                    self._one(plan, store.counted(), system, self.runs, counted=True)
        return list(self.cases.values())

    # -- one system, one repetition ------------------------------------------------------

    def _one(self, plan: StorePlan, store: StoreInfo, system: str, rep: int,
             *, counted: bool) -> None:
        tag = "count" if counted else f"r{rep}"
        safe = system.replace("[", "_").replace("]", "")
        path = f"bench/{self.run_id}/{plan.name}/{safe}/{tag}"
        try:
            ok = self._job(plan, store, system, "save", self.world_size, path, counted, rep)
            if not ok:
                return
            if self.evict_cache:
                self.stores.evict(plan.name, path)
            self._job(plan, store, system, "load", self.world_size, path, counted, rep)
            target = get_system(system)
            # a counting run's reshard loads are for the peers' bytes on the wire;
            # dcpstore counts its own bytes read in the timed runs
            if not target.is_limit and not (counted and target.is_dcpstore):
                for m in plan.reshard:
                    if self.evict_cache:
                        self.stores.evict(plan.name, path)
                    self._job(plan, store, system, "load", m, path, counted, rep)
        finally:
            self.stores.delete(plan.name, path)

    def _job(self, plan: StorePlan, store: StoreInfo, system: str, op: str, world_size: int,
             path: str, counted: bool, rep: int) -> bool:
        case = self._case(plan, system, op, world_size)
        job = Job(op=op, system=system, store=store, path=path, workload=plan.workload,
                  options=self.options(system), counted=counted)
        proxy = self.stores.proxies.get(plan.name) if counted else None
        if proxy is not None:
            proxy.reset_stats()
        started = time.monotonic()
        try:
            results = self._pool(world_size).run(job, self.job_timeout(plan.workload.state_bytes))
        except JobError as exc:
            self.jobs_done += 1
            what = "counting run" if counted else f"run {rep + 1}"
            case.errors.append(f"{what}: {exc}")
            first = str(exc).strip().splitlines()
            self.progress(f"[{self.jobs_done:3d}/{self.jobs_total}] {plan.name:<9} {system:<22} "
                          f"{op:<4} @{world_size}  FAILED: {first[0] if first else exc}")
            logger.debug("job failed:\n%s", exc)
            return False
        self.jobs_done += 1
        per_rank = [r.to_dict() for r in results]
        if counted:
            case.counted = _counted_figures(results, proxy)
        else:
            case.runs.append(per_rank)
        self._report_progress(plan, system, op, world_size, results, counted, rep,
                              time.monotonic() - started)
        return all(r.verified is not False for r in results)

    def _report_progress(self, plan: StorePlan, system: str, op: str, world_size: int,
                         results: list[RankResult], counted: bool, rep: int,
                         wall: float) -> None:
        seconds = max(r.seconds for r in results)
        mbps = plan.workload.state_bytes / seconds / 1e6 if seconds > 0 else 0.0
        what = "count" if counted else f"run {rep + 1}/{self.runs}"
        verified = ""
        if op == "load":
            verified = "  verified" if all(r.verified for r in results) else "  MISMATCH"
        self.progress(
            f"[{self.jobs_done:3d}/{self.jobs_total}] {plan.name:<9} {system:<22} {op:<4} "
            f"@{world_size}  {what:<9} {format_bytes(plan.workload.state_bytes):>8} "
            f"{seconds:7.2f} s {mbps:8.1f} MB/s{verified}  (job {wall:.1f} s)")


def rotated(systems: list[str], rep: int) -> list[str]:
    """The order of run ``rep``: the list rotated by ``rep`` (A B C, B C A, C A B), so
    that no system always runs first, or right after the same neighbour's save."""
    if not systems:
        return []
    k = rep % len(systems)
    return systems[k:] + systems[:k]


def _counted_figures(results: list[RankResult], proxy: Any) -> dict[str, Any]:
    figures: dict[str, Any] = {
        "seconds": max(r.seconds for r in results),
        "rchar": sum(r.rchar for r in results),
        "per_rank": [r.to_dict() for r in results],
        "verified": all(r.verified is not False for r in results),
    }
    if proxy is not None:
        stats = proxy.stats
        figures.update(requests=dict(stats.requests), bytes_up=int(stats.bytes_up),
                       bytes_down=int(stats.bytes_down))
    return figures
