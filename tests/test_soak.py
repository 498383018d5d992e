"""A bounded soak: many save/load cycles leave nothing behind.

A small model and its Adam state go through ``dcpstore.Checkpointer(root, keep_last=2)``
on the local disk, S3 (moto) and GCS (fake-gcs-server), alternating a blocking
checkpointer and an ``async_mode="thread"`` one on the same root, with a load after
every save. Quick: 4 cycles per store (12 in all); ``--full``: 50 per store. Each data
file is larger than one upload part, so S3 multipart and GCS composite uploads run
every cycle, and each save writes two files per rank (the writer's file threads).

Afterwards, with the checkpointers closed, this file proves:

- **no leaked threads**: after every cycle no dcpstore worker thread is alive (each save
  and load closes the backend it made, which joins its workers, whenever the garbage
  collector runs), and at the end the threads alive equal those before the soak
  (counted before any ``gc.collect()``), except the one process-wide ``fsspecIO``
  event-loop thread that fsspec starts once and every gcsfs filesystem reuses (see
  :mod:`dcpstore_gcs.backend`); the servers' own request threads (moto runs in this
  process) are not counted;
- **no leaked file descriptors**: no file, pipe or other descriptor stays open that
  was not open before, and at most ``2 x max_concurrency`` more sockets are open. The
  tolerance is for idle keep-alive sockets, whose number the pools bound (a 50-cycle
  run ends with the count it started with): gcsfs keeps one cached aiohttp session per
  process whose pool may hold idle connections to fake-gcs-server, and moto (in this
  process) holds the server end of a connection until the client's close reaches it.
  Anonymous temporary files (``/tmp/#<inode> (deleted)``) are not counted on S3: they
  are moto's own storage of the retained objects' bodies (its ``SpooledTemporaryFile``
  rolls large ones to disk);
- **no open multipart uploads** (S3 ``ListMultipartUploads``) and **no leftover parts**
  of GCS composite uploads (under ``.dcpstore-uploads/``);
- **no orphan objects**: the listing of the root is exactly the files of the retained
  steps (``.metadata``, the manifest, the data files ``.metadata`` references);
- every retained step verifies and loads bit-exact; ``latest()`` is the last step.
"""

from __future__ import annotations

import copy
import gc
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from stores import Store

import dcpstore
from dcpstore.dcp import layout
from dcpstore.dcp.safe_pickle import safe_loads
from dcpstore.testing import assert_state_equal
from dcpstore.tools.ops import remove_checkpoint, verify_checkpoint
from dcpstore.training.checkpointer import step_dir
from dcpstore.training.latest import POINTER_KEY, read_pointer

logger = logging.getLogger(__name__)

QUICK_CYCLES, FULL_CYCLES = 4, 50
#: Threads that may outlive the soak: started once per process and reused by design.
REUSED_THREADS = ("fsspecIO",)
#: Requests in flight per backend; bounds the clients' keep-alive pools.
CONCURRENCY = 4
#: Idle keep-alive sockets allowed to stay open (see the module docstring).
FD_TOLERANCE = 2 * CONCURRENCY


#: Writer and backend options of the soak on each kind of store (small parts: many
#: requests per save).
_PART_SIZE = {"s3": 5 * 1024 * 1024, "gcs": 256 * 1024, "msc": 5 * 1024 * 1024}

#: SeaweedFS is reached by the same S3 client as moto, and the soak measures the client's
#: leaks (threads, descriptors, uploads), not the server's: moto stands for both.
pytestmark = pytest.mark.parametrize("store", ["local", "moto", "gcs", "msc"],
                                     indirect=True)


def _options(store: Store) -> dict[str, Any]:
    """Every option of the soak's saves (writer options included)."""
    part = {"part_size": _PART_SIZE[store.kind]} if store.kind in _PART_SIZE else {}
    return {**store.options, **part, "files_per_rank": 2, "max_concurrency": CONCURRENCY}


# -- the workload -------------------------------------------------------------------------


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    # ~1M parameters: 4 MiB of weights + 8 MiB of Adam state per save, one file > 1 part
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 512))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 512, generator=g)
    loss = model(x).pow(2).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()


def _snapshot(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    return copy.deepcopy(dcpstore.AppState(model, optim).state_dict())


def _load_and_compare(ckpt: dcpstore.Checkpointer, step: int,
                      expected: dict[str, Any]) -> None:
    model, optim = _model()
    app = dcpstore.AppState(model, optim)
    assert ckpt.load({"app": app}, step=step) == step
    assert_state_equal(app.state_dict(), expected)


# -- leak accounting -----------------------------------------------------------------------


def _fds() -> Counter[str]:
    """Open descriptors of this process by kind: ``socket``, ``pipe``, ``anon-tmp``
    (an unnamed temporary file) or the file's path."""
    kinds: Counter[str] = Counter()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (e.g. the listing's own descriptor)
            continue
        if target.startswith("socket:"):
            kinds["socket"] += 1
        elif target.startswith("pipe:"):
            kinds["pipe"] += 1
        elif os.path.basename(target).startswith("#") and target.endswith("(deleted)"):
            kinds["anon-tmp"] += 1
        else:
            kinds[target] += 1
    return kinds


def _server_thread(t: threading.Thread) -> bool:
    """Threads of the in-process moto server (werkzeug), not of dcpstore."""
    return "process_request_thread" in t.name or "_server_entry" in t.name


def _library_threads() -> list[str]:
    """Worker threads of dcpstore's backends and writers alive right now."""
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("dcpstore-"))


def _extra_threads(before: set[threading.Thread], wait: float = 15.0) -> list[str]:
    """Threads alive now that were not before (waiting for exiting ones to finish)."""
    deadline = time.monotonic() + wait
    while True:
        extra = [t for t in threading.enumerate()
                 if t not in before and t.is_alive() and not _server_thread(t)
                 and t.name not in REUSED_THREADS]
        if not extra or time.monotonic() > deadline:
            return sorted(f"{t.name} (daemon={t.daemon})" for t in extra)
        for t in extra:
            t.join(0.2)


def _open_uploads(store: Store) -> list[str]:
    if store.kind in ("s3", "msc"):
        return store.uploads(store.root)  # raw ListMultipartUploads
    backend = dcpstore.open_backend(store.root, **_backend_options(store))
    try:
        return [key for key, _ in backend.list_uploads()]
    finally:
        backend.close()


def _backend_options(store: Store) -> dict[str, Any]:
    return {k: v for k, v in _options(store).items() if k != "files_per_rank"}


def _expected_objects(store: Store, steps: list[int]) -> set[str]:
    root = dcpstore.open_backend(store.root, **_backend_options(store))
    keys: set[str] = set()
    try:
        for step in steps:
            ckpt = root.child(step_dir(step))
            md = safe_loads(ckpt.get(layout.METADATA_KEY))
            files = {i.relative_path for i in md.storage_data.values()}
            assert len(files) == 2, files  # files_per_rank=2
            files |= {layout.METADATA_KEY, layout.manifest_key(md.storage_meta.save_id)}
            keys |= {f"{step_dir(step)}/{f}" for f in files}
        if steps:  # the latest pointer, naming the newest step
            keys.add(POINTER_KEY)
            pointer = read_pointer(root)
            assert pointer is not None and pointer.step == max(steps)
    finally:
        root.close()
    return keys


# -- the soak ------------------------------------------------------------------------------


@pytest.fixture
def warm(store: Store) -> Iterator[None]:
    """One save and load first, so that process-wide singletons (botocore's loader,
    fsspec's event loop thread, gcsfs's session) exist before anything is counted."""
    uri = f"{store.root}-warmup"
    model, optim = _model()
    dcpstore.save({"app": dcpstore.AppState(model, optim)}, uri, **_options(store))
    dcpstore.load({"app": dcpstore.AppState(*_model())}, uri, **_backend_options(store))
    remove_checkpoint(uri, **_backend_options(store))
    gc.collect()
    yield


def test_soak(store: Store, warm: None, full_run: bool) -> None:
    cycles = FULL_CYCLES if full_run else QUICK_CYCLES
    threads_before = set(threading.enumerate())
    fds_before = _fds()

    model, optim = _model()
    expected: dict[int, dict[str, Any]] = {}
    blocking = dcpstore.Checkpointer(store.root, keep_last=2, **_options(store))
    background = dcpstore.Checkpointer(store.root, keep_last=2, async_mode="thread",
                                       **_options(store))
    try:
        for cycle in range(cycles):
            step = 10 * (cycle + 1)
            _train_step(model, optim, step)
            expected[step] = _snapshot(model, optim)
            ckpt = background if cycle % 2 else blocking
            ckpt.save(step, {"app": dcpstore.AppState(model, optim)})
            if ckpt is background:
                _train_step(model, optim, step + 1)  # trains while the upload runs
                ckpt.wait()
            assert ckpt.latest() == step
            _load_and_compare(ckpt, step, expected[step])
            # every save and load closed the backend it made: its workers are joined,
            # whenever the garbage collector happens to run
            assert _library_threads() == [], f"cycle {cycle}: {_library_threads()}"
    finally:
        blocking.close()
        background.close()

    steps = [10 * (c + 1) for c in range(cycles)]
    retained = steps[-2:]
    check = dcpstore.Checkpointer(store.root, **_options(store))
    try:
        assert check.steps() == retained
        assert check.latest() == retained[-1]
        for step in retained:
            report = verify_checkpoint(f"{store.root}/{step_dir(step)}",
                                       **_backend_options(store))
            assert report.ok and report.files == 2, report.errors
            _load_and_compare(check, step, expected[step])
    finally:
        check.close()

    root = dcpstore.open_backend(store.root, **_backend_options(store))
    try:
        listed = {o.key for o in root.list()}
    finally:
        root.close()
    assert listed == _expected_objects(store, retained), "orphan or missing objects"
    assert _open_uploads(store) == [], "unfinished multipart/composite uploads"

    leaked = _extra_threads(threads_before)  # before any gc.collect(): nothing hidden
    assert leaked == [], f"threads left running after the soak: {leaked}"
    gc.collect()
    fds_after = _fds()
    new = fds_after - fds_before
    summary = (f"{store.name}: {cycles} cycles ({cycles // 2} async), fds "
               f"{sum(fds_before.values())} -> {sum(fds_after.values())} (new: {dict(new)}), "
               f"threads {len(threads_before)} -> {threading.active_count()}, retained "
               f"{retained}, objects {len(listed)}")
    logger.info("soak %s", summary)
    print(f"\n[soak] {summary}")
    if store.kind in ("s3", "msc"):
        new.pop("anon-tmp", None)  # moto's storage of object bodies
    assert new["socket"] <= FD_TOLERANCE, summary
    new.pop("socket", None)
    assert not new, f"descriptors left open: {dict(new)}"
