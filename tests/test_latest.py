"""The latest pointer: cheap, verified, right after a crash between commit and pointer.

Single process (the coordinator's logic); the root is a local directory or the in-memory
store that counts requests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from stores import Store, build_store, memory_scheme

import dcpstore
from dcpstore.dcp import layout
from dcpstore.storage.local import LocalBackend
from dcpstore.testing import MemoryBackend
from dcpstore.tools.ops import remove_checkpoint
from dcpstore.training.latest import POINTER_KEY, pointer_holds, read_pointer, step_dir

BUCKET = "latest-pointer"
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", autouse=True)
def _memory_scheme() -> Iterator[None]:
    yield from memory_scheme(BUCKET)


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((8, 4), float(step)), "b": torch.arange(5) + step}


def _pointer(root: str) -> dict[str, object]:
    return json.loads((Path(root) / POINTER_KEY).read_text())


def test_latest_reads_the_pointer_not_every_object() -> None:
    uri = f"memory://{BUCKET}/{uuid.uuid4().hex[:8]}"
    ckpt = dcpstore.Checkpointer(uri, keep_last=3)
    for step in (10, 20, 30, 40):
        ckpt.save(step, _state(step))
    MemoryBackend.reset_requests(BUCKET)
    assert dcpstore.Checkpointer(uri).latest() == 40
    # pointer GET, one ranged GET of .metadata's tail, one delimiter listing after it
    assert MemoryBackend.requests(BUCKET) == {"get": 1, "range_get": 1, "list": 1}
    root = MemoryBackend(f"{BUCKET}/{uuid.uuid4().hex[:8]}")
    assert read_pointer(root) is None
    ckpt.close()


def test_steady_save_requests_do_not_grow_with_the_saves() -> None:
    """Retention after a save lists step directories once and confirms each step it
    counts or deletes (one HEAD of its ``.metadata``, not one listing of its objects),
    except the step the save just committed: ``keep_last`` HEADs, however many steps
    were saved before."""
    uri = f"memory://{BUCKET}/{uuid.uuid4().hex[:8]}"
    ckpt = dcpstore.Checkpointer(uri, keep_last=4)
    counts = []
    for step in range(1, 8):
        MemoryBackend.reset_requests(BUCKET)
        ckpt.save(step, _state(step))
        counts.append(MemoryBackend.requests(BUCKET))
    assert [int(s) for s in ckpt.steps()] == [4, 5, 6, 7]
    # steps 5.. each retained up to 4 and deleted one: the same requests every time
    assert counts[4] == counts[5] == counts[6]
    last = counts[6]
    assert last["put"] == 3  # manifest, .metadata, the latest pointer
    # the pointer's version (its compare-and-swap: a store with conditional writes),
    # then the 3 older kept steps and the deleted one, confirmed
    assert last["head"] == 5
    assert last["get"] == 2  # the target check; the pointer (its compare-and-swap)
    assert last["list"] == 2  # the step directories (delimiter), the deleted step's objects
    ckpt.close()


def test_pointer_lost_stale_or_damaged_never_names_an_uncommitted_step(
        tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    ckpt = dcpstore.Checkpointer(root)
    for step in (1, 2, 3):
        ckpt.save(step, _state(step))
    assert _pointer(root)["step"] == 3
    backend = LocalBackend(root)
    good = backend.get(POINTER_KEY)

    # an uncommitted newer step (data files, no .metadata) is never latest
    (tmp_path / "run" / step_dir(9)).mkdir()
    (tmp_path / "run" / step_dir(9) / "__0_0.0123456789abcdef.distcp").write_bytes(b"x")
    assert dcpstore.Checkpointer(root).latest() == 3

    # a lost pointer update: it names step 1, step 3 is committed
    backend.put(POINTER_KEY, good.replace(b'"step": 3', b'"step": 1')
                .replace(step_dir(3).encode(), step_dir(1).encode()))
    assert dcpstore.Checkpointer(root).latest() == 3

    # the pointer's step lost its .metadata (deleted): the listing decides
    backend.put(POINTER_KEY, good)
    os.unlink(tmp_path / "run" / step_dir(3) / layout.METADATA_KEY)
    assert dcpstore.Checkpointer(root).latest() == 2
    assert [int(s) for s in dcpstore.Checkpointer(root).steps()] == [1, 2]

    # a damaged pointer, or none at all
    backend.put(POINTER_KEY, b"{not json")
    assert dcpstore.Checkpointer(root).latest() == 2
    backend.delete([POINTER_KEY])
    assert dcpstore.Checkpointer(root).latest() == 2

    # the pointer's step was overwritten by another save (another save id): not trusted
    over = dcpstore.Checkpointer(root, overwrite=True)
    over.save(2, _state(22))
    assert _pointer(root)["step"] == 2
    backend.put(POINTER_KEY, good.replace(b'"step": 3', b'"step": 2')
                .replace(step_dir(3).encode(), step_dir(2).encode()))
    stale = read_pointer(backend)
    assert stale is not None and not pointer_holds(backend, stale)
    assert dcpstore.Checkpointer(root).latest() == 2  # by listing
    assert dcpstore.Checkpointer(root).load(_state(0)) == 2
    over.close()
    ckpt.close()


_KILLED_BETWEEN_COMMIT_AND_POINTER = textwrap.dedent("""
    import os, signal, sys, torch
    import dcpstore
    from dcpstore.training import root as ckpt_root
    root = sys.argv[1]
    ckpt = dcpstore.Checkpointer(root, keep_last=3)
    for step in (1, 2):
        ckpt.save(step, {"w": torch.full((4,), float(step))})
    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)
    ckpt_root.write_pointer = die   # step 3 commits, then the process is killed
    ckpt.save(3, {"w": torch.full((4,), 3.0)})
    print("not killed")
""")


def test_sigkill_between_commit_and_pointer_update(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _KILLED_BETWEEN_COMMIT_AND_POINTER, root],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert (tmp_path / "run" / step_dir(3) / layout.METADATA_KEY).exists()
    assert _pointer(root)["step"] == 2  # the update was lost
    ckpt = dcpstore.Checkpointer(root, keep_last=3)
    assert ckpt.latest() == 3
    assert [int(s) for s in ckpt.steps()] == [1, 2, 3]
    state = {"w": torch.zeros(4)}
    assert ckpt.load(state) == 3 and torch.equal(state["w"], torch.full((4,), 3.0))
    ckpt.save(4, {"w": torch.full((4,), 4.0)})  # the next save repairs the pointer
    assert _pointer(root)["step"] == 4
    assert [int(s) for s in ckpt.steps()] == [2, 3, 4]
    ckpt.close()


def test_latest_during_concurrent_retention(tmp_path: Path) -> None:
    """Another process's view (a second Checkpointer) while saves commit and retention
    deletes: latest() never goes back, never names a step that is not committed."""
    root = str(tmp_path / "run")
    writer = dcpstore.Checkpointer(root, keep_last=2)
    writer.save(0, _state(0))
    seen: list[int] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def watch() -> None:
        reader = dcpstore.Checkpointer(root)
        try:
            while not done.is_set():
                found = reader.latest()
                assert found is not None
                seen.append(int(found))
                listed = [int(s) for s in reader.steps()]
                assert listed and listed == sorted(listed)
        except BaseException as exc:
            errors.append(exc)
        finally:
            reader.close()

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for step in range(1, 9):
            writer.save(step, _state(step))
    finally:
        done.set()
        watcher.join()
    assert not errors, errors
    assert seen == sorted(seen) and seen[-1] <= 8
    assert [int(s) for s in writer.steps()] == [7, 8]
    assert writer.latest() == 8
    writer.close()


@pytest.mark.parametrize("store_name", ["local", "seaweedfs"])
def test_steps_and_retention_confirm_steps_deleted_from_outside(
        store_name: str, request: pytest.FixtureRequest, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps this process saw committed and that were deleted since by someone else
    (``dcpstore rm``; another job's deletion that got as far as ``.metadata``) are not
    listed, and retention does not count them: ``keep_last`` real steps stay. Local disk
    and SeaweedFS keep a directory whose objects were deleted."""
    store: Store = build_store(store_name, request, tmp_path, monkeypatch)
    uri = store.uri("run")
    ckpt = dcpstore.Checkpointer(uri, keep_last=3, **store.options)
    for step in (1, 2, 3, 4):
        ckpt.save(step, _state(step))
    assert [int(s) for s in ckpt.steps()] == [2, 3, 4]

    remove_checkpoint(ckpt.step_uri(3), **store.options)  # `dcpstore rm`, another process
    outside = store.backend(uri)
    try:  # another job deleting step 4 got as far as its .metadata (deleted first)
        outside.delete([f"{step_dir(4)}/{layout.METADATA_KEY}"])
    finally:
        outside.close()
    assert [int(s) for s in ckpt.steps()] == [2]
    assert ckpt.latest() == 2

    # retention counts real steps only: nothing goes until 3 are committed
    ckpt.save(5, _state(5))
    assert [int(s) for s in ckpt.steps()] == [2, 5]
    ckpt.save(6, _state(6))
    assert [int(s) for s in ckpt.steps()] == [2, 5, 6]
    ckpt.save(7, _state(7))
    assert [int(s) for s in ckpt.steps()] == [5, 6, 7]
    fresh = dcpstore.Checkpointer(uri, **store.options)
    assert [int(s) for s in fresh.steps()] == [5, 6, 7]
    out = _state(0)
    assert fresh.load(out, step=5) == 5 and torch.equal(out["w"], _state(5)["w"])
    fresh.close()
    ckpt.close()
