"""Overwrite safety: a failed or concurrent ``overwrite=True`` save never mixes states.

What this file proves, on local disk and on S3 (SeaweedFS):

- An ``overwrite=True`` save over a committed 2-rank checkpoint in which one rank's
  write path fails (before writing, while staging a tensor, mid-upload, at the upload
  commit, on the coordinator mid-upload, at the manifest put, at the ``.metadata``
  put) raises on every rank and leaves the old checkpoint exactly as it was: the same
  objects with the same bytes, no dangling multipart upload, a bit-exact load and a
  passing ``verify``.
- A ``.metadata`` put that the store applied but whose response was lost (a timeout
  after the commit) leaves the new checkpoint committed and whole, never a
  ``.metadata`` whose files were cleaned up.
- The contrast: torch's own ``FileSystemWriter(overwrite=True)`` in the same two
  scenarios rewrites its fixed-name data files in place, so a rank failing before it
  writes leaves a checkpoint that loads *silently mixed* (rank 0's shard new, rank 1's
  shard old), and a rank failing mid-write destroys the old checkpoint (it no longer
  loads); dcpstore, in the same process group with the same faults, keeps the old one.
- Two concurrent saves to the same URI with ``overwrite=True`` and different contents
  (two threads in one process, and two independent 2-rank process groups), with seeded
  random delays before every store request, both succeed and leave exactly one of the
  two states: it loads bit-exact and ``verify`` passes; ``gc`` then removes the
  loser's files and leaves exactly the winner's.

Quick run: 3 thread seeds per store, 2 process-group seeds on local disk and 1 on S3;
``--full``: 24 and 8.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from crash_workers import (
    AMBIGUOUS_FAULT,
    FAULTS,
    concurrent_save,
    contrast_overwrite,
    empty_state,
    full_state,
    jitter_patches,
    load_with_torch,
    overwrite_with_faults,
    set_jitter,
    shard_rows,
)
from mp import run_killable
from stores import Store

import dcpstore
from dcpstore.dcp import layout
from dcpstore.testing import assert_state_equal
from dcpstore.tools import ops

logger = logging.getLogger(__name__)

MiB = 1024 * 1024


#: Small parts: a data file is a multipart upload.
STORE_OPTIONS = {"s3": {"part_size": 5 * MiB}}

#: Two-rank runs cost seconds each: the local store (commit by rename) and one S3 server
#: (commit by PUT) cover both commit paths. Tests without a store: a clean environment.
STORES = pytest.mark.parametrize("store", ["local", "seaweedfs"], indirect=True)
pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("clean_env")]


def _launch(fn: Any, *args: Any, store: Store, tmp_path: Path, tag: str) -> list[Any]:
    """Run ``fn`` on 2 ranks; every rank must return (the faults are caught inside)."""
    result = run_killable(fn, 2, *args, outdir=str(tmp_path / tag), env=store.env)
    assert result.crash is None and result.killed_survivors == [], result
    for rank in (0, 1):
        assert result.results[rank]["status"] == "ok", result.results[rank].get("error")
    return [result.results[r]["value"] for r in (0, 1)]


def _load(store: Store, uri: str) -> dict[str, Any]:
    out = empty_state()
    dcpstore.load(out, uri, **store.options)
    return out


def _committed_files(store: Store, uri: str) -> set[str]:
    info = ops.inspect_checkpoint(uri, **store.options)
    return {layout.METADATA_KEY, layout.manifest_key(info["save_id"]), *info["files"]}


def _assert_intact(store: Store, uri: str, version: int) -> None:
    """``uri`` holds exactly save ``version``: bit-exact, verified, nothing else stored."""
    assert_state_equal(_load(store, uri), full_state(version))
    report = ops.verify_checkpoint(uri, **store.options)
    assert report.ok and report.has_manifest, report.errors
    assert store.files(uri) == _committed_files(store, uri)
    assert store.uploads(uri) == []


# -- one rank fails during an overwrite -------------------------------------------------------


@STORES
def test_failed_overwrite_leaves_old_checkpoint_unchanged(store: Store, tmp_path: Path
                                                         ) -> None:
    uri = store.uri("failed-overwrite")
    faults = list(FAULTS)
    results = _launch(overwrite_with_faults, uri, store.options, faults, store=store,
                      tmp_path=tmp_path, tag="ranks")
    baseline = results[0]["baseline"]
    assert len([k for k in baseline if k.endswith(".distcp")]) == 2
    for fault in faults:
        for rank in (0, 1):  # every rank raises, and says why
            error = results[rank]["errors"][fault]
            assert error is not None and "injected" in error, (fault, rank, error)
        # the same objects with the same bytes after each failed overwrite
        assert results[0]["snapshots"][fault] == baseline, fault
    _assert_intact(store, uri, 1)
    assert store.files(uri) == set(baseline)
    logger.info("%s: %d failed overwrites, old checkpoint unchanged", store.name, len(faults))


@STORES
def test_commit_whose_response_was_lost_is_not_torn(store: Store, tmp_path: Path) -> None:
    """The ``.metadata`` PUT lands but the writer sees a timeout: the writer must not
    treat the save as failed and delete the files the new ``.metadata`` names."""
    uri = store.uri("lost-response")
    results = _launch(overwrite_with_faults, uri, store.options, [AMBIGUOUS_FAULT],
                      store=store, tmp_path=tmp_path, tag="ranks")
    assert_state_equal(_load(store, uri), full_state(2))  # the commit happened
    assert [r["errors"][AMBIGUOUS_FAULT] for r in results] == [None, None]
    ops.gc(uri, min_age=0, **store.options)  # the overwritten save's files, if left
    _assert_intact(store, uri, 2)


# -- the contrast: torch's FileSystemWriter(overwrite=True) ----------------------------------


def _which(actual: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> str:
    return "old" if torch.equal(actual, old) else "new" if torch.equal(actual, new) else "other"


@pytest.mark.parametrize("fault", ["rank1-before-write", "rank1-resolve"])
def test_torch_filesystem_writer_overwrite_is_not_safe(fault: str, tmp_path: Path) -> None:
    torch_path = str(tmp_path / "torch")
    uri = str(tmp_path / "dcpstore")
    local = Store("local", str(tmp_path), {}, {})
    results = _launch(contrast_overwrite, torch_path, uri, fault, store=local,
                      tmp_path=tmp_path, tag="ranks")
    for rank in (0, 1):  # both writers report the failure on every rank
        assert results[rank]["torch"] is not None and "injected" in results[rank]["torch"]
        assert results[rank]["dcpstore"] is not None

    old, new = full_state(1), full_state(2)
    # torch: data files have fixed names (__0_0.distcp, __1_0.distcp) and are rewritten
    # in place, while the old .metadata stays
    assert sorted(os.listdir(torch_path)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    if fault == "rank1-before-write":
        # rank 0 rewrote its file, rank 1 never opened its own: the load succeeds
        # without an error and returns a mix of the two saves
        loaded = load_with_torch(torch_path)
        (a0, b0), (a1, b1) = shard_rows()
        assert _which(loaded["big"][a0:b0], old["big"][a0:b0], new["big"][a0:b0]) == "new"
        assert _which(loaded["big"][a1:b1], old["big"][a1:b1], new["big"][a1:b1]) == "old"
        assert _which(loaded["big"], old["big"], new["big"]) == "other"
        assert loaded["meta"] == old["meta"]  # .metadata still describes save 1
    else:
        # rank 1 truncated its file and died half-way: the old checkpoint is gone
        with pytest.raises(BaseException) as failed:
            load_with_torch(torch_path)
        assert not isinstance(failed.value, (KeyboardInterrupt, SystemExit))

    # dcpstore, same process group, same fault: the old checkpoint is untouched
    _assert_intact(local, uri, 1)


# -- concurrent saves to one URI --------------------------------------------------------------


def _seeds(full_run: bool, quick: int, full: int) -> range:
    return range(full if full_run else quick)


def _check_one_of(store: Store, uri: str, versions: tuple[int, int]) -> int:
    """``uri`` holds exactly one of ``versions``, whole; gc leaves exactly it. Returns
    the version."""
    loaded = _load(store, uri)
    version = loaded["meta"]["version"]
    assert version in versions, (version, versions)
    assert_state_equal(loaded, full_state(version))
    report = ops.verify_checkpoint(uri, **store.options)
    assert report.ok and report.has_manifest, report.errors
    ops.gc(uri, min_age=0, **store.options)  # the losing save's files
    _assert_intact(store, uri, version)
    return int(version)


@STORES
def test_concurrent_overwrites_in_threads_never_mix(store: Store, full_run: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    for owner, name, wrapper in jitter_patches():
        monkeypatch.setattr(owner, name, wrapper)
    winners: dict[str, int] = {}
    for seed in _seeds(full_run, 3, 24):
        uri = store.uri(f"threads-{seed}")
        if seed % 2:  # half the runs replace an existing checkpoint
            dcpstore.save(full_state(50 + seed), uri, **store.options)
        versions = (100 + 2 * seed, 101 + 2 * seed)
        states = {v: full_state(v) for v in versions}
        errors: dict[int, BaseException | None] = {}
        barrier = threading.Barrier(2)

        def save(version: int, seed: int = seed, uri: str = uri,
                 states: dict[int, Any] = states,
                 errors: dict[int, BaseException | None] = errors,
                 barrier: threading.Barrier = barrier) -> None:
            set_jitter(f"{seed}-{version}")
            barrier.wait()
            try:
                dcpstore.save(states[version], uri, overwrite=True, **store.options)
                errors[version] = None
            except BaseException as exc:
                errors[version] = exc

        threads = [threading.Thread(target=save, args=(v,)) for v in versions]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
        assert errors == {v: None for v in versions}, errors
        key = "first" if _check_one_of(store, uri, versions) == versions[0] else "second"
        winners[key] = winners.get(key, 0) + 1
    logger.info("%s: concurrent thread saves, winners %s", store.name, winners)


@STORES
def test_concurrent_overwrites_from_two_process_groups_never_mix(
        store: Store, full_run: bool, tmp_path: Path) -> None:
    winners: dict[str, int] = {}
    for seed in _seeds(full_run, 2 if store.server is None else 1, 8):
        uri = store.uri(f"groups-{seed}")
        if seed % 2:
            dcpstore.save(full_state(60 + seed), uri, **store.options)
        versions = (200 + 2 * seed, 201 + 2 * seed)
        rendezvous = tmp_path / f"rendezvous-{seed}"
        rendezvous.mkdir()
        outcome: dict[int, Any] = {}

        def job(version: int, seed: int = seed, uri: str = uri,
                outcome: dict[int, Any] = outcome, rendezvous: Path = rendezvous) -> None:
            outcome[version] = _launch(concurrent_save, uri, store.options, version,
                                       str(rendezvous), 2, seed, store=store,
                                       tmp_path=tmp_path, tag=f"g{seed}-{version}")

        threads = [threading.Thread(target=job, args=(v,)) for v in versions]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert sorted(outcome) == sorted(versions), "a process group did not finish"
        assert all(errs == [None, None] for errs in outcome.values()), outcome
        key = "first" if _check_one_of(store, uri, versions) == versions[0] else "second"
        winners[key] = winners.get(key, 0) + 1
    logger.info("%s: concurrent process-group saves, winners %s", store.name, winners)
