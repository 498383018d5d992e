"""Runs the plan: every system's save and load on every store, interleaved, then the
untimed request-counting runs, and collects what the ranks measured.

Order within a store (``--runs 6``, systems A B C D; :func:`balanced_order`)::

    run 1: C.save C.load [C.load@M ...]  A ...  D ...  B ...     (a random permutation)
    run 2: B ...  D ...  A ...  C ...                            (its reverse)
    run 3: A ...  D ...  B ...  C ...                            (another permutation)
    run 4: C ...  B ...  D ...  A ...                            (its reverse)
    ...
    counting (one run, through the proxy): A.save A.load [A.load@M]  B ...  C ...
    (every system but the limits and a peer's defaults whose [best] runs)

Interleaving spreads slow drifts of the machine over every system. Pairing each seeded
random permutation with its reverse balances the order: for every two systems A and B,
A runs before B in exactly half the runs (with an even ``--runs``), so neither always
goes first (say, onto a store whose disk has just been flushed), and the neighbours
change from pair to pair. The seed and every run's order are recorded in the results.

Before each system's save (between cases), the store's bytes written are accounted
(:meth:`benchmarks.servers.Stores.reserve`): a SeaweedFS past its budget is replaced by
a fresh, empty server first, so that its lazy space reclaim cannot fail a run.

Every save goes to a fresh prefix, the loads (at the save's world size, then at each
reshard world size) read that checkpoint, and the prefix is deleted before the next
system runs, so no system reads what another wrote and the stores do not fill up.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .ranks import Job, JobError, RankPool, RankResult
from .servers import STORE_KINDS, StoreInfo, Stores
from .systems import get as get_system
from .workload import WorkloadSpec, format_bytes

__all__ = ["Case", "Runner", "StorePlan", "balanced_order", "precedence_counts"]

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
        secondary: Systems with no reshard loads and no counting run: a peer's
            defaults, when its ``[best]`` runs too (those are judged at the best).
    """

    name: str
    workload: WorkloadSpec
    systems: list[str]
    reshard: list[int] = field(default_factory=list)
    note: str = ""
    skipped: dict[str, str] = field(default_factory=dict)
    secondary: list[str] = field(default_factory=list)

    def counted(self, system: str) -> bool:
        """Whether ``system`` gets the untimed counting run (on a server with a proxy):
        every system but a peer's defaults (its ``[best]`` is counted) and the limits
        (their requests are their variant's arithmetic: parts or objects)."""
        return system not in self.secondary and not get_system(system).is_limit

    def reshard_for(self, system: str) -> list[int]:
        """The reshard world sizes ``system`` is loaded at (none for the limits)."""
        if get_system(system).is_limit or system in self.secondary:
            return []
        return list(self.reshard)

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
        job_seconds: Wall time of each job of the case as the orchestrator saw it
            (timed runs, failed ones and the counting run, in the order they ran):
            the timed part plus the job's set-up, verification and hand-over.
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
    job_seconds: list[float] = field(default_factory=list)

    @property
    def key(self) -> tuple[str, str, str, int]:
        """(store, system, op, world size)."""
        return (self.store, self.system, self.op, self.world_size)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (raw measurements; the report adds the summaries)."""
        return {"store": self.store, "system": self.system, "op": self.op,
                "world_size": self.world_size, "saved_at": self.saved_at,
                "state_bytes": self.state_bytes, "runs": self.runs, "counted": self.counted,
                "errors": self.errors, "job_seconds": self.job_seconds}


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
        options: ``(store, system label, op) -> options`` (``--opt``, a variant's own,
            the tuned best).
        job_timeout: Seconds a job may take, as a function of the state size.
        progress: Called with one line per finished job.
    """

    def __init__(self, stores: Stores, pools: dict[int, RankPool],
                 pool_factory: Callable[[int], RankPool], *, world_size: int, runs: int,
                 count_requests: bool, evict_cache: bool,
                 options: Callable[[str, str, str], dict[str, Any]],
                 job_timeout: Callable[[int], float],
                 progress: Callable[[str], None] = print, seed: int = 0,
                 label: str = "") -> None:
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
        self.seed = seed
        self.label = label
        #: store -> the system order of every timed run
        self.orders: dict[str, list[list[str]]] = {}
        #: store -> seconds of wall time of its timed runs and of its counting runs
        self.phase_seconds: dict[str, dict[str, float]] = {}
        #: every replacement of a server by a fresh one (:meth:`Stores.reserve`)
        self.replacements: list[dict[str, Any]] = []
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
                reshard = len(plan.reshard_for(system))
                total += (2 + reshard) * runs
                if counting and plan.counted(system):
                    total += 2 + reshard
        return total

    def run(self, plans: list[StorePlan]) -> list[Case]:
        """Run every plan; return the cases (failed runs are recorded, not raised)."""
        self.jobs_total = self.count_jobs(plans, self.runs, self.count_requests)
        for i, plan in enumerate(plans):
            store = self.stores.info[plan.name]
            orders = self.orders[plan.name] = balanced_order(plan.systems, self.runs,
                                                             self.seed + i)
            started = time.monotonic()
            for rep, order in enumerate(orders):
                for system in order:
                    self._one(plan, system, rep, counted=False)
            self.phase_seconds[plan.name] = {"timed runs": time.monotonic() - started}
            if self.count_requests and store.proxy_url is not None:
                started = time.monotonic()
                for system in plan.systems:
                    if plan.counted(system):
                        self._one(plan, system, self.runs, counted=True)
                self.phase_seconds[plan.name]["counting runs"] = time.monotonic() - started
        return list(self.cases.values())

    # -- one system, one repetition ------------------------------------------------------

    def _one(self, plan: StorePlan, system: str, rep: int, *, counted: bool) -> None:
        tag = "count" if counted else f"r{rep}"
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in system)
        path = f"bench/{self.run_id}/{plan.name}/{safe}/{tag}"
        # between cases, nothing on the store is needed any more: a server that took
        # its budget of writes is replaced by a fresh one here (Stores.reserve)
        started = time.monotonic()
        if self.stores.reserve(plan.name, plan.workload.state_bytes):
            self.replacements.append({
                "store": plan.name, "before": f"{system} {tag}",
                "restart": self.stores.restarts.get(plan.name, 0),
                "seconds": round(time.monotonic() - started, 2)})
            self.progress(f"{self.label}  {plan.name}: replaced by a fresh server (its "
                          f"budget of {format_bytes(self.stores.budgets[plan.name])} "
                          "written)")
        store = self.stores.info[plan.name]
        if counted:
            store = store.counted()
        try:
            ok = self._job(plan, store, system, "save", self.world_size, path, counted, rep)
            if not ok:
                return
            if self.evict_cache:
                self.stores.evict(plan.name, path)
            self._job(plan, store, system, "load", self.world_size, path, counted, rep)
            # the counting run's reshard loads give every system's bytes on the wire,
            # dcpstore's included (not its own count)
            for m in plan.reshard_for(system):
                if self.evict_cache:
                    self.stores.evict(plan.name, path)
                self._job(plan, store, system, "load", m, path, counted, rep)
        finally:
            self.stores.delete(plan.name, path)

    def _job(self, plan: StorePlan, store: StoreInfo, system: str, op: str, world_size: int,
             path: str, counted: bool, rep: int) -> bool:
        case = self._case(plan, system, op, world_size)
        job = Job(op=op, system=system, store=store, path=path, workload=plan.workload,
                  options=self.options(plan.name, system, op), counted=counted)
        proxy = self.stores.proxies.get(plan.name) if counted else None
        if proxy is not None:
            proxy.reset_stats()
        started = time.monotonic()
        try:
            results = self._pool(world_size).run(job, self.job_timeout(plan.workload.state_bytes))
        except JobError as exc:
            self.jobs_done += 1
            case.job_seconds.append(round(time.monotonic() - started, 3))
            what = "counting run" if counted else f"run {rep + 1}"
            case.errors.append(f"{what}: {exc}")
            first = str(exc).strip().splitlines()
            self.progress(f"{self.label}[{self.jobs_done:3d}/{self.jobs_total}] {plan.name:<9} "
                          f"{system:<22} {op:<4} @{world_size}  FAILED: "
                          f"{first[0] if first else exc}")
            logger.debug("job failed:\n%s", exc)
            return False
        self.jobs_done += 1
        case.job_seconds.append(round(time.monotonic() - started, 3))
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
            f"{self.label}[{self.jobs_done:3d}/{self.jobs_total}] {plan.name:<9} {system:<22} "
            f"{op:<4} "
            f"@{world_size}  {what:<9} {format_bytes(plan.workload.state_bytes):>8} "
            f"{seconds:7.2f} s {mbps:8.1f} MB/s{verified}  (job {wall:.1f} s)")


def balanced_order(systems: list[str], runs: int, seed: int) -> list[list[str]]:
    """The system order of each of ``runs`` runs: seeded random permutations, each
    followed by its reverse, so that with an even ``runs`` every system runs before
    every other one in exactly half the runs; the permutations differ from pair to pair
    (as far as there are enough of them), so the neighbours change too.

    Args:
        systems: The systems of one store.
        runs: Timed runs (an odd count ends with an unpaired permutation).
        seed: Seed of the permutations (recorded with the results).
    """
    rng = random.Random(seed)
    orders: list[list[str]] = []
    used: set[tuple[str, ...]] = set()
    while len(orders) < runs:
        perm = list(systems)
        for _ in range(50):  # a permutation (or its reverse) not used yet, if there is one
            rng.shuffle(perm)
            if tuple(perm) not in used:
                break
        used.update({tuple(perm), tuple(reversed(perm))})
        orders.append(list(perm))
        if len(orders) < runs:
            orders.append(perm[::-1])
    return orders


def precedence_counts(orders: list[list[str]]) -> dict[tuple[str, str], int]:
    """``(a, b) -> in how many of ``orders`` a runs before b``."""
    counts: dict[tuple[str, str], int] = {}
    for order in orders:
        for i, a in enumerate(order):
            for b in order[i + 1:]:
                counts[(a, b)] = counts.get((a, b), 0) + 1
    return counts


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
