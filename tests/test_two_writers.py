"""Two jobs writing one run root at once (issue 31): on every store of the matrix, two
real processes race to save the same step URI, 20 rounds each.

- ``overwrite=False``: on a store with conditional writes exactly one job commits and
  the other gets ``CheckpointExistsError`` naming the URI and the winner's save id; the
  checkpoint is entirely the winner's (its files alone, verified, loaded bit-exact).
  Without conditional writes (MSC) a job may still lose late; the checkpoint is never
  torn or mixed, and a job that was told it lost left nothing behind.
- ``overwrite=True``: both commit; the last commit wins whole, and on a store with
  conditional writes it also removes the files of the commit it replaced.
- The latest pointer, published by two jobs' Checkpointers at once, never moves
  backwards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from mp import run_ranks
from race_workers import async_save_in_own_group, job_state, publish_steps, race_saves
from stores import Store

import dcpstore
from dcpstore.dcp import layout
from dcpstore.dcp.metadata_io import load_metadata
from dcpstore.storage.local import LocalBackend
from dcpstore.tools import ops
from dcpstore.torch_internals import portable_metadata_bytes
from dcpstore.training.latest import step_dir

ROUNDS = 20


def _winner(store: Store, uri: str) -> str:
    """The committed save's id."""
    backend = store.backend(uri)
    try:
        save_id = layout.save_id_of_metadata(load_metadata(backend)[0])
    finally:
        backend.close()
    assert save_id is not None
    return save_id


def _load(store: Store, uri: str) -> dict[str, torch.Tensor]:
    out = {k: torch.empty_like(v) for k, v in job_state(0, 0).items()}
    dcpstore.load(out, uri, **store.options)
    return out


def _whose(state: dict[str, torch.Tensor], round_: int, jobs: tuple[int, ...]) -> int:
    for job in jobs:
        expected = job_state(job, round_)
        if all(torch.equal(state[k], expected[k]) for k in expected):
            return job
    raise AssertionError(f"round {round_}: the checkpoint holds neither job's state "
                         "(torn or mixed)")


def _data_saves(store: Store, uri: str) -> set[str | None]:
    """The save ids of the data files and manifests under ``uri``."""
    return {layout.save_id_of(k) for k in store.files(uri) if k != layout.METADATA_KEY}


def _race(store: Store, tag: str, overwrite: bool) -> tuple[str, list[Any], bool]:
    """Two jobs racing for ``ROUNDS`` rounds: the root, what each job saw, and whether
    the store has conditional writes."""
    root = store.uri(tag)
    seen = run_ranks(race_saves, 2, root, store.options, ROUNDS, overwrite, timeout=600)
    return root, seen, store.backend().conditional_writes


def _round(store: Store, root: str, r: int) -> tuple[str, int]:
    """Round ``r``'s checkpoint, loaded whole and verified: its URI and whose it is."""
    uri = f"{root}/race-{r:03d}"
    holder = _whose(_load(store, uri), r, (0, 1))
    report = ops.verify_checkpoint(uri, **store.options)
    assert report.ok, (r, report.errors)
    return uri, holder


def test_two_jobs_one_step_one_winner(store: Store) -> None:
    root, seen, conditional = _race(store, "race", overwrite=False)
    for r in range(ROUNDS):
        uri, holder = _round(store, root, r)
        outcome = [seen[job][r] for job in (0, 1)]
        winners = [job for job in (0, 1) if outcome[job]["ok"]]
        save_id = _winner(store, uri)
        if conditional:
            assert winners == [holder], (r, outcome)
            loser = outcome[1 - holder]
            assert uri in loser["error"] and save_id in loser["error"], loser
            # entirely the winner's: no file of the loser's save is left
            assert _data_saves(store, uri) == {save_id}, (r, store.files(uri))
        else:
            assert holder in winners, (r, outcome)  # the loser may not know (see docs)
            for job in (0, 1):
                if not outcome[job]["ok"]:
                    assert save_id in outcome[job]["error"], outcome[job]
            if len(winners) == 1:
                assert _data_saves(store, uri) == {save_id}, (r, store.files(uri))


def test_two_jobs_overwriting_last_commit_wins_whole(store: Store) -> None:
    root, seen, conditional = _race(store, "race-ow", overwrite=True)
    for r in range(ROUNDS):
        uri, _ = _round(store, root, r)  # whole, and one of the two racing saves
        assert all(seen[job][r]["ok"] for job in (0, 1)), r
        if conditional:  # the last commit removed the files of the one it replaced
            assert _data_saves(store, uri) == {_winner(store, uri)}, store.files(uri)


@pytest.mark.parametrize("store", ["local", "moto", "seaweedfs", "gcs", "azure"], indirect=True)
def test_latest_pointer_never_moves_backwards(store: Store) -> None:
    root = store.uri("race-latest")
    pointed = run_ranks(publish_steps, 2, root, store.options, ROUNDS, timeout=600)
    # after round r both jobs committed steps 2r and 2r+1: the pointer names 2r+1
    for job in (0, 1):
        assert pointed[job] == [2 * r + 1 for r in range(ROUNDS)], pointed[job]


def test_retention_spares_another_jobs_save_in_progress(tmp_path: Path) -> None:
    """A job's retention deletes an old step that another job is saving again right
    now: the other save's data files (no manifest yet) stay, so its commit is whole."""
    root = str(tmp_path / "run")
    ckpt = dcpstore.Checkpointer(root, keep_last=2)
    ckpt.save(1, job_state(0, 1))
    ckpt.save(2, job_state(0, 2))
    step1 = tmp_path / "run" / step_dir(1)
    in_flight = layout.data_file_name(0, 0, layout.new_save_id())
    (step1 / in_flight).write_bytes(b"another job's data, its commit still to come")
    ckpt.save(3, job_state(0, 3))  # retention: step 1 goes
    ckpt.close()
    assert [p.name for p in step1.iterdir()] == [in_flight]
    assert not (step1 / layout.METADATA_KEY).exists()


def test_reader_refuses_a_mixed_checkpoint(tmp_path: Path) -> None:
    """A race no store decided (or files copied in by hand): a ``.metadata`` naming data
    files of another save is refused by the reader and by ``verify``, naming both."""
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    dcpstore.save(job_state(0, 0), first)
    dcpstore.save(job_state(1, 0), second)
    a, b = LocalBackend(first), LocalBackend(second)
    metadata, _ = load_metadata(a)
    ours = layout.save_id_of_metadata(metadata)
    theirs = layout.save_id_of_metadata(load_metadata(b)[0])
    for info in metadata.storage_data.values():  # the other save's data, same layout
        name = info.relative_path.replace(ours.removeprefix("dcpstore-"),
                                          theirs.removeprefix("dcpstore-"))
        a.put(name, b.get(name))
        info.relative_path = name
    a.put(layout.METADATA_KEY, portable_metadata_bytes(metadata), atomic=True)
    with pytest.raises(dcpstore.IntegrityError, match=f"{ours}.*{theirs}"):
        dcpstore.load({k: torch.empty_like(v) for k, v in job_state(0, 0).items()}, first)
    report = ops.verify_checkpoint(first)
    assert not report.ok and any(theirs in e and "mixed" in e for e in report.errors)


def test_two_drains_of_one_step_one_commits(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Two jobs drain their local tier's copy of one step to one root: the second one's
    check sees nothing yet (the first commits right after it), and its conditional
    commit refuses to replace the first's ``.metadata``."""
    from dcpstore.training.local_tier import DrainError, copy_rank_files, publish_step

    local_a, local_b = tmp_path / "a" / "step-1", tmp_path / "b" / "step-1"
    dcpstore.save(job_state(0, 1), str(local_a))
    dcpstore.save(job_state(1, 1), str(local_b))
    remote = LocalBackend(str(tmp_path / "root" / "step-1"))
    for local in (local_a, local_b):
        copy_rank_files(str(local), remote, 0, True)
    publish_step(str(local_a), remote)
    committed = remote.get(layout.METADATA_KEY)
    real_get, seen = LocalBackend.get, []

    def get(self: LocalBackend, key: str) -> bytes:
        if key == layout.METADATA_KEY and not seen:  # job A commits just after this
            seen.append(key)
            raise FileNotFoundError(key)
        return real_get(self, key)

    monkeypatch.setattr(LocalBackend, "get", get)
    with pytest.raises(DrainError, match="another job committed this step"):
        publish_step(str(local_b), remote)
    monkeypatch.undo()
    assert remote.get(layout.METADATA_KEY) == committed
    out = {k: torch.empty_like(v) for k, v in job_state(0, 1).items()}
    dcpstore.load(out, str(tmp_path / "root" / "step-1"))
    assert all(torch.equal(out[k], v) for k, v in job_state(0, 1).items())


def test_a_job_on_a_subgroup_makes_its_side_group_alone(tmp_path: Path) -> None:
    """A Checkpointer on a process group of its own (another job shares the world) in
    thread mode: its background side group has its ranks and is made by them alone
    (it was made over the whole world: job 0 waited for job 1 until the timeout)."""
    root = str(tmp_path / "run")
    assert run_ranks(async_save_in_own_group, 2, root, {}, timeout=60) == [0, 1]
    out = {k: torch.empty_like(v) for k, v in job_state(0, 1).items()}
    dcpstore.load(out, f"{root}/{step_dir(1)}")
    assert all(torch.equal(out[k], v) for k, v in job_state(0, 1).items())
