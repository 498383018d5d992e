"""Two jobs at once on one checkpoint URI (``tests/test_two_writers.py``): each rank here
is a job of its own that saves in a process group of its own; the world group only
lines up the start of each round, so the two saves race.

Each function returns what its job saw, per round; the test judges the store.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import dcpstore
from dcpstore.training.latest import read_pointer

__all__ = ["job_state", "publish_steps", "race_saves"]

#: Elements per tensor: big enough for a few data files per save.
_N = 64 * 1024


def job_state(job: int, round_: int) -> dict[str, torch.Tensor]:
    """What ``job`` saves in ``round_``: values that tell every job and round apart."""
    base = float(job * 1000 + round_)
    return {f"w{i}": torch.full((_N,), base + i / 10) for i in range(4)}


def _own_groups(jobs: int) -> list[Any]:
    """A process group per job, of that rank alone: each job's saves involve it alone,
    as two separate jobs' would (every rank makes every group, in the same order)."""
    return [dist.new_group([j]) for j in range(jobs)]


def race_saves(job: int, jobs: int, root: str, options: dict[str, Any], rounds: int,
               overwrite: bool) -> list[dict[str, Any]]:
    """Save ``job_state(job, r)`` to ``<root>/race-<r>`` in each round, at the same moment
    as the other job. With ``overwrite=True`` a checkpoint is there already (job 0
    saves it, before the round)."""
    own = _own_groups(jobs)[job]
    seen = []
    for r in range(rounds):
        uri = f"{root}/race-{r:03d}"
        if overwrite and job == 0:
            dcpstore.save(job_state(9, r), uri, process_group=own, files_per_rank=2,
                          **options)
        dist.barrier()
        try:
            dcpstore.save(job_state(job, r), uri, process_group=own, overwrite=overwrite,
                          files_per_rank=2, **options)
            seen.append({"round": r, "ok": True})
        except dcpstore.CheckpointExistsError as exc:
            seen.append({"round": r, "ok": False, "error": str(exc)})
    dist.barrier()
    return seen


def publish_steps(job: int, jobs: int, root: str, options: dict[str, Any],
                  rounds: int) -> list[int | None]:
    """Each round, job ``j`` saves step ``jobs * r + j`` through its own Checkpointer at
    the same moment as the others; after the round, every job reads the latest pointer
    (it must name the round's newest step: it never moves backwards)."""
    ckpt = dcpstore.Checkpointer(root, process_group=_own_groups(jobs)[job], **options)
    pointed = []
    try:
        for r in range(rounds):
            dist.barrier()
            ckpt.save(jobs * r + job, job_state(job, r))
            dist.barrier()
            pointer = read_pointer(ckpt._root.backend)
            pointed.append(None if pointer is None else pointer.step)
    finally:
        ckpt.close()
    return pointed


def async_save_in_own_group(job: int, jobs: int, root: str, options: dict[str, Any]) -> int:
    """Job 0 saves through a thread-mode Checkpointer on a process group of its own
    while job 1 does nothing with dcpstore: job 0's background side group must be made
    by job 0 alone."""
    own = _own_groups(jobs)[job]
    if job == 0:
        ckpt = dcpstore.Checkpointer(root, process_group=own, async_mode="thread",
                                     **options)
        ckpt.save(1, job_state(0, 1))
        ckpt.wait()
        ckpt.close()
    dist.barrier()
    return job
