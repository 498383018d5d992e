"""The incremental-save benchmark's workloads and its arithmetic (no timing)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `pytest` run as a script does not put the repo root there
    sys.path.insert(0, str(REPO))

from benchmarks.incremental import (  # noqa: E402
    evaluate_targets,
    lora_state,
    render_markdown,
    summarize,
    training_state,
)

MiB = 1 << 20


def test_lora_workload_is_95_percent_frozen() -> None:
    state, step = lora_state(16 * MiB)
    model = state["app"].model
    frozen = sum(p.nbytes for p in model.parameters() if not p.requires_grad)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    changed = step()
    trainable = sum(p.nbytes for p in model.parameters() if p.requires_grad)
    assert changed == 3 * trainable  # parameters, exp_avg, exp_avg_sq
    assert 0.93 <= frozen / (frozen + changed) <= 0.97
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) == k.startswith("base.") for k in before)


def test_training_workload_changes_everything() -> None:
    state, step = training_state(4 * MiB)
    before = {k: v.clone() for k, v in state.items()}
    assert step() == sum(v.nbytes for v in state.values())
    assert not any(torch.equal(before[k], state[k]) for k in state)


def _run(seconds: float, written: int, changed: int, load: float | None) -> dict[str, Any]:
    saves = [{"seconds": 9.0, "cpu_s": 9.0, "written": 100, "referenced": 0,
              "changed": changed}]
    saves += [{"seconds": seconds, "cpu_s": seconds / 2, "written": written,
               "referenced": 100 - written, "changed": changed} for _ in range(4)]
    return {"saves": saves, "load_s": load}


def test_summary_and_targets() -> None:
    raw = {
        "lora/full": [_run(1.0, 100, 5, 0.5), _run(1.2, 100, 5, 0.7)],
        "lora/incremental": [_run(0.1, 5, 5, 0.5), _run(0.3, 5, 5, 0.9)],
        "train/no-hash": [_run(1.0, 100, 100, None)],
        "train/hash": [_run(1.2, 100, 100, None)],
    }
    summary = summarize(raw)
    assert summary["lora/full"]["seconds"] == {"median": 1.1, "min": 1.0, "max": 1.2}
    assert summary["lora/incremental"]["first_seconds"]["median"] == 9.0  # save 1 apart
    targets = evaluate_targets(summary, hash_s=0.04)
    # bytes met; time 0.18x for 0.05x bytes: not met; load 1.17x: not met;
    # hashing +20% wall and +20% CPU: not met; the hash alone, 4% of 1 s: met
    assert [t["met"] for t in targets] == [True, False, False, False, False, True], targets
    assert "| lora/incremental |" in render_markdown(
        {"summary": {"local": summary}, "targets": {"local": evaluate_targets(summary)},
         "size_mib": 1, "runs": 2})
