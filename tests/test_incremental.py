"""Incremental checkpoints: references into earlier steps of the same run root.

What is written and what is referenced, torch's own readers on an incremental step,
retention / rm / gc / cp / verify / inspect / export that follow references, hostile
references, a retention run racing a save, SIGKILL during an incremental save, and a
2-rank FSDP2 run with frozen and trainable parts on local disk and SeaweedFS (resumed
bit-exactly from each step, at the same and at another world size).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import pickle
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from incremental_workers import FROZEN, load_steps, save_steps
from mp import run_ranks
from stores import Store
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem

import dcpstore
import dcpstore.training.weights
from dcpstore.dcp import layout, references
from dcpstore.dcp.checksum import crc32c
from dcpstore.dcp.manifest import FileRecord
from dcpstore.dcp.metadata_io import load_metadata, read_manifest
from dcpstore.errors import IntegrityError, UnsafeKeyError
from dcpstore.testing import assert_state_equal
from dcpstore.tools import ops
from dcpstore.tools.cli import main as cli_main

BASE_KEYS = [f"base.w{i}" for i in range(4)]


def lora_state(seed: int = 0) -> dict[str, Any]:
    """A frozen base (~95% of the bytes) and small adapters with AdamW-like moments."""
    g = torch.Generator().manual_seed(seed)
    return {
        "base": {f"w{i}": torch.randn(128, 256, generator=g) for i in range(4)},
        "lora": {"a": torch.randn(8, 256, generator=g), "b": torch.randn(128, 8, generator=g)},
        "adam": {"a": torch.zeros(8, 256), "b": torch.zeros(128, 8)},
        "step": torch.tensor(0),
    }


def advance(state: dict[str, Any]) -> int:
    """One 'training step' on the adapters; returns the bytes that changed."""
    changed = 0
    for group in ("lora", "adam"):
        for t in state[group].values():
            t.add_(0.5)
            changed += t.nbytes
    state["step"].add_(1)
    return changed


def zeros_like(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return {k: zeros_like(v) for k, v in state.items()}


def save(state: dict[str, Any], uri: str, **options: Any) -> dcpstore.Writer:
    writer = dcpstore.get_writer(uri, **options)
    dcp.save(state, storage_writer=writer, no_dist=True)
    return writer


def paths_of(uri: str) -> dict[str, str]:
    md = load_metadata(dcpstore.open_backend(uri))[0]
    return {index.fqn: info.relative_path for index, info in md.storage_data.items()}


def load_back(uri: str, like: dict[str, Any]) -> dict[str, Any]:
    out = zeros_like(like)
    dcpstore.load(out, uri)
    return out


# -- the writer and readers ----------------------------------------------------------------


def test_incremental_save_writes_only_changed_payloads(tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    root = tmp_path / "run"
    state = lora_state()
    full = save(state, f"{root}/step-1")
    assert full.bytes_referenced == 0
    changed = advance(state)
    inc = save(state, f"{root}/step-2", base=f"{root}/step-1")
    # the target: <= 1.1 x the changed bytes + metadata (item archive headers)
    assert inc.bytes_written <= 1.1 * changed + 16 * 1024, (inc.bytes_written, changed)
    assert inc.bytes_referenced >= sum(state["base"][k].nbytes for k in state["base"])
    step2 = paths_of(f"{root}/step-2")
    assert all(step2[k].startswith("../step-1/__0_0.") for k in BASE_KEYS)
    assert not any(step2[k].startswith("..") for k in ("lora.a", "adam.b", "step"))
    manifest = read_manifest(dcpstore.open_backend(f"{root}/step-2"),
                             load_metadata(dcpstore.open_backend(f"{root}/step-2"))[0]
                             .storage_meta.save_id)
    assert manifest is not None and set(manifest.references) == {step2["base.w0"]}

    advance(state)
    save(state, f"{root}/step-3", base=f"{root}/step-2")
    step3 = paths_of(f"{root}/step-3")
    assert step3["base.w0"] == step2["base.w0"]  # to the step holding the bytes: no chains

    for reader in (dcpstore.get_reader(f"{root}/step-3"), FileSystemReader(f"{root}/step-3"),
                   FsspecReader(f"file://{root}/step-3")):
        out = zeros_like(state)
        dcp.load(out, storage_reader=reader, no_dist=True)
        assert_state_equal(out, state)


def test_frozen_hint_skips_hashing_but_checks_shape(tmp_path: Path) -> None:
    root = tmp_path / "run"
    state = lora_state()
    save(state, f"{root}/step-1")
    state["base"]["w0"].add_(1.0)  # breaks the promise: the hint is trusted, not hashed
    state["base"]["w1"] = torch.randn(64, 256)  # another shape: never referenced
    save(state, f"{root}/step-2", base=f"{root}/step-1",
         frozen=["base.w0", "base.w1", "base.w2"])
    paths = paths_of(f"{root}/step-2")
    assert paths["base.w0"].startswith("../") and paths["base.w2"].startswith("../")
    assert not paths["base.w1"].startswith("../")
    out = load_back(f"{root}/step-2", state)
    assert not torch.equal(out["base"]["w0"], state["base"]["w0"])  # stale, as promised
    assert torch.equal(out["base"]["w1"], state["base"]["w1"])

    # without the hint the change is seen by the hash
    save(state, f"{root}/step-3", base=f"{root}/step-1")
    assert not paths_of(f"{root}/step-3")["base.w0"].startswith("../")
    assert_state_equal(load_back(f"{root}/step-3", state), state)


def test_base_without_hashes_or_missing(tmp_path: Path) -> None:
    root = tmp_path / "run"
    state = lora_state()
    save(state, f"{root}/step-1", content_hash=False)  # like a manifest from before hashes
    inc = save(state, f"{root}/step-2", base=f"{root}/step-1")
    assert inc.bytes_referenced == 0
    with pytest.raises(dcpstore.CheckpointNotFoundError, match="not a committed"):
        dcpstore.save(state, f"{root}/step-3", base=f"{root}/step-9")
    assert not (root / "step-3").exists()
    assert list((root / references.PINS_DIR).iterdir()) == []  # its pin was removed
    inc = save(state, f"{root}/step-4", base=f"{root}/step-9", base_required=False)
    assert inc.bytes_referenced == 0
    with pytest.raises(dcpstore.DcpstoreError, match="sibling"):
        dcpstore.save(state, f"{tmp_path}/elsewhere/step-5", base=f"{root}/step-1")


# -- retention, rm, gc, cp, verify, inspect, export ---------------------------------------


def test_checkpointer_retention_keeps_referenced_files(tmp_path: Path) -> None:
    root = tmp_path / "run"
    state = lora_state()
    saved = {}
    with dcpstore.Checkpointer(str(root), incremental=True, keep_last=2) as ckpt:
        for step in range(1, 5):
            advance(state)
            ckpt.save(step, state)
            saved[step] = {k: v.clone() if isinstance(v, torch.Tensor) else
                           {n: t.clone() for n, t in v.items()} for k, v in state.items()}
        assert [int(s) for s in ckpt.steps()] == [3, 4]
        # step 1 holds the frozen base that 3 and 4 reference: no .metadata, files kept
        kept = sorted(p.name for p in (root / "step-000000001").iterdir())
        assert layout.METADATA_KEY not in kept and references.RETIRED_KEY in kept
        assert len([k for k in kept if k.endswith(".distcp")]) == 1
        assert not (root / "step-000000002").exists()  # nothing of it is referenced
        for step in (3, 4):
            out = zeros_like(state)
            ckpt.load(out, step=step)
            assert_state_equal(out, saved[step])
        assert ops.verify_checkpoint(ckpt.step_uri(3)).ok
        ckpt.delete(3)
        assert (root / "step-000000001").exists()  # still referenced by step 4
        ckpt.delete(4)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == []


def test_plain_checkpointer_on_an_incremental_root_keeps_referenced_files(
        tmp_path: Path) -> None:
    """Retention without references to follow skips reading the kept steps, but only
    where no incremental save ever ran: a plain Checkpointer resuming an incremental run
    still keeps the files a retained step references."""
    plain, run = tmp_path / "plain", tmp_path / "run"
    state = lora_state()
    with dcpstore.Checkpointer(str(plain), keep_last=1) as ckpt:
        ckpt.save(1, state)
        ckpt.save(2, state)
    assert not (plain / references.INCREMENTAL_DIR).exists()
    assert not (plain / "step-000000001").exists()

    with dcpstore.Checkpointer(str(run), incremental=True) as ckpt:
        ckpt.save(1, state)
        advance(state)
        ckpt.save(2, state)  # references step 1's frozen base
    assert (run / references.INCREMENTAL_DIR).is_dir()
    with dcpstore.Checkpointer(str(run), keep_last=2) as ckpt:
        advance(state)
        ckpt.save(3, state)  # a full save; retention deletes step 1, which 2 references
        assert [int(s) for s in ckpt.steps()] == [2, 3]
        out = zeros_like(state)
        ckpt.load(out, step=2)
    assert ops.verify_checkpoint(f"{run}/step-000000002").ok
    kept = sorted(p.name for p in (run / "step-000000001").iterdir())
    assert layout.METADATA_KEY not in kept and references.RETIRED_KEY in kept


def test_overwriting_a_referenced_step_keeps_what_later_steps_reference(
        tmp_path: Path) -> None:
    root = tmp_path / "run"
    state = lora_state()
    save(state, f"{root}/step-1")
    advance(state)
    inc = save(state, f"{root}/step-2", base=f"{root}/step-1")
    assert inc.bytes_referenced > 0
    # step 1 saved again, whole and different: step 2's references into the old save stay
    other = lora_state(seed=1)
    save(other, f"{root}/step-1", overwrite=True)
    assert_state_equal(load_back(f"{root}/step-2", state), state)
    assert ops.verify_checkpoint(f"{root}/step-2").ok
    assert_state_equal(load_back(f"{root}/step-1", other), other)
    # a plain run root (no incremental save ever) still deletes the overwritten files
    plain = tmp_path / "plain"
    save(state, f"{plain}/step-1")
    before = {p.name for p in (plain / "step-1").iterdir()}
    save(other, f"{plain}/step-1", overwrite=True)
    assert not before & {p.name for p in (plain / "step-1").iterdir()
                         if p.name.endswith(".distcp")}


def test_gc_keeps_what_an_unreadable_step_may_reference(tmp_path: Path) -> None:
    root = tmp_path / "run"
    state = lora_state()
    with dcpstore.Checkpointer(str(root), incremental=True, keep_last=1) as ckpt:
        ckpt.save(1, state)
        advance(state)
        ckpt.save(2, state)  # references step 1, which retention retires
    retired = root / "step-000000001"
    held = sorted(p.name for p in retired.iterdir() if p.name.endswith(".distcp"))
    assert held and not (retired / layout.METADATA_KEY).exists()
    # step 2's .metadata cannot be read now: gc cannot tell what it references
    (root / "step-000000002" / layout.METADATA_KEY).write_bytes(b"not a pickle")
    ops.gc(str(root), min_age=0)
    assert sorted(p.name for p in retired.iterdir() if p.name.endswith(".distcp")) == held


def test_ops_follow_references(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "run"
    state = lora_state()
    save(state, f"{root}/step-1")
    advance(state)
    save(state, f"{root}/step-2", base=f"{root}/step-1")
    step2 = f"{root}/step-2"

    info = ops.inspect_checkpoint(step2)
    base_bytes = sum(t.nbytes for t in state["base"].values())
    assert info["referenced_bytes"] >= base_bytes > info["stored_bytes"]
    assert cli_main(["inspect", step2]) == 0
    assert "referenced in 1 files of earlier steps" in capsys.readouterr().out

    report = ops.verify_checkpoint(step2)
    assert report.ok and report.files == 2, report.errors

    # cp: self-contained by default; --keep-references keeps the ../ paths
    ops.copy_checkpoint(step2, f"{tmp_path}/copy")
    assert not any(p.startswith("..") for p in paths_of(f"{tmp_path}/copy").values())
    assert ops.verify_checkpoint(f"{tmp_path}/copy").ok
    assert_state_equal(load_back(f"{tmp_path}/copy", state), state)
    assert cli_main(["cp", "--keep-references", step2, f"{root}/step-2-copy"]) == 0
    assert paths_of(f"{root}/step-2-copy")["base.w0"].startswith("../step-1/")
    assert_state_equal(load_back(f"{root}/step-2-copy", state), state)

    # export follows references
    dcpstore.training.weights.export(step2, str(tmp_path / "export.pt"))
    exported = torch.load(tmp_path / "export.pt", weights_only=True)
    assert torch.equal(exported["base.w3"], state["base"]["w3"])

    # rm of the base: it stops being a checkpoint, the referenced file stays
    assert cli_main(["rm", "--dry-run", f"{root}/step-1"]) == 0
    assert (root / "step-1" / layout.METADATA_KEY).exists()
    ops.remove_checkpoint(f"{root}/step-1")
    names = sorted(p.name for p in (root / "step-1").iterdir())
    assert layout.METADATA_KEY not in names and references.RETIRED_KEY in names
    listed = {c.path: c for c in ops.list_checkpoints(str(root))}
    assert listed["step-1"].retired and not listed["step-1"].committed
    assert cli_main(["ls", str(root)]) == 0
    assert "retired" in capsys.readouterr().out
    assert ops.gc(str(root), min_age=0).objects == []
    assert_state_equal(load_back(step2, state), state)
    assert ops.verify_checkpoint(step2).ok

    # a damaged referenced file is found by verify of the step that references it
    data = next(p for p in (root / "step-1").iterdir() if p.name.endswith(".distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert not ops.verify_checkpoint(step2).ok
    with pytest.raises(IntegrityError):
        load_back(step2, state)

    # once no committed step references it, the retired step goes away
    ops.remove_checkpoint(step2)
    ops.remove_checkpoint(f"{root}/step-2-copy")
    assert not (root / "step-1").exists()


# -- hostile references -------------------------------------------------------------------


def _rewrite_metadata(uri: str, path_of: dict[str, str]) -> None:
    """Point storage entries elsewhere and re-record .metadata's CRC in its manifest (a
    consistent but hostile checkpoint)."""
    backend = dcpstore.open_backend(uri)
    md, _ = load_metadata(backend)
    md.storage_data = {i: dataclasses.replace(s, relative_path=path_of.get(i.fqn,
                                                                           s.relative_path))
                       for i, s in md.storage_data.items()}
    raw = pickle.dumps(md)
    manifest = read_manifest(backend, md.storage_meta.save_id)
    assert manifest is not None
    manifest.metadata = FileRecord(len(raw), crc32c(raw))
    backend.put(layout.manifest_key(md.storage_meta.save_id), manifest.to_bytes())
    backend.put(layout.METADATA_KEY, raw)


def test_hostile_references_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "run"
    state = lora_state()
    save(state, f"{root}/step-1")
    save(state, f"{root}/step-2")
    (tmp_path / "secret").mkdir()
    victim = next(p.name for p in (root / "step-1").iterdir() if p.name.endswith(".distcp"))
    (tmp_path / "secret" / victim).write_bytes((root / "step-1" / victim).read_bytes())

    # out of the run root: refused before anything is read, verified or not
    _rewrite_metadata(f"{root}/step-2", {"base.w0": f"../../secret/{victim}"})
    for verify in (True, False):
        with pytest.raises(UnsafeKeyError):
            dcpstore.load(zeros_like(state), f"{root}/step-2", verify=verify)

    # into a sibling, but not a reference the save recorded: refused too
    save(state, f"{root}/step-3")
    _rewrite_metadata(f"{root}/step-3", {"base.w0": f"../step-1/{victim}"})
    for verify in (True, False):
        with pytest.raises(UnsafeKeyError, match="not a reference its integrity manifest"):
            dcpstore.load(zeros_like(state), f"{root}/step-3", verify=verify)
    for op in (ops.verify_checkpoint, ops.inspect_checkpoint):
        with pytest.raises(UnsafeKeyError):
            op(f"{root}/step-3")
    with pytest.raises(UnsafeKeyError):
        ops.copy_checkpoint(f"{root}/step-3", f"{tmp_path}/copy")


# -- a concurrent retention run, and crashes ----------------------------------------------


class _RetentionMidSave(DefaultSavePlanner):
    """Runs a retention of ``doomed`` while the save writes its first item (after the
    coordinator pinned and read the base)."""

    def __init__(self, root: str, doomed: list[str]) -> None:
        super().__init__()
        self.root, self.doomed, self.done = root, doomed, False

    def resolve_data(self, write_item: WriteItem) -> Any:
        if not self.done:
            self.done = True
            pins = references.read_pins(dcpstore.open_backend(self.root))
            assert [p.steps for p in pins] == [["step-1"]]
            references.delete_steps(dcpstore.open_backend(self.root), self.doomed)
        return super().resolve_data(write_item)


def test_retention_during_a_save_keeps_what_it_references(tmp_path: Path) -> None:
    root = tmp_path / "run"
    state = lora_state()
    save(state, f"{root}/step-1")
    advance(state)
    writer = dcpstore.get_writer(f"{root}/step-2", base=f"{root}/step-1")
    planner = _RetentionMidSave(str(root), ["step-1"])
    dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
    assert planner.done and writer.bytes_referenced > 0
    # step 1 lost its .metadata mid-save, but the pin kept its files
    assert not (root / "step-1" / layout.METADATA_KEY).exists()
    assert_state_equal(load_back(f"{root}/step-2", state), state)
    assert list((root / references.PINS_DIR).iterdir()) == []
    # and afterwards the committed step 2 protects them (a retention run now)
    references.delete_steps(dcpstore.open_backend(str(root)), [])
    assert ops.verify_checkpoint(f"{root}/step-2").ok

    # retention that removed the base before the save read it: a full save
    references.delete_steps(dcpstore.open_backend(str(root)), ["step-2"])
    save(state, f"{root}/step-3")
    references.delete_steps(dcpstore.open_backend(str(root)), ["step-3"])
    inc = save(state, f"{root}/step-4", base=f"{root}/step-3", base_required=False)
    assert inc.bytes_referenced == 0
    assert_state_equal(load_back(f"{root}/step-4", state), state)


def _killed_save(root: str) -> None:
    """Child process: an incremental save that SIGKILLs itself while writing."""

    class Die(DefaultSavePlanner):
        def resolve_data(self, write_item: WriteItem) -> Any:
            if write_item.index.fqn == "lora.b":
                os.kill(os.getpid(), signal.SIGKILL)
            return super().resolve_data(write_item)

    state = lora_state()
    advance(state)
    dcp.save(state, storage_writer=dcpstore.get_writer(f"{root}/step-2",
                                                       base=f"{root}/step-1"),
             planner=Die(), no_dist=True)


def test_sigkill_during_an_incremental_save(tmp_path: Path) -> None:
    root = tmp_path / "run"
    state = lora_state()
    save(state, f"{root}/step-1")
    proc = mp.get_context("spawn").Process(target=_killed_save, args=(str(root),))
    proc.start()
    proc.join(120)
    assert proc.exitcode == -signal.SIGKILL
    assert not (root / "step-2" / layout.METADATA_KEY).exists()
    assert len(list((root / references.PINS_DIR).iterdir())) == 1  # the crashed save's
    # a retention run while the crashed save's pin is there keeps step 1's data files
    references.delete_steps(dcpstore.open_backend(str(root)), [])
    assert_state_equal(load_back(f"{root}/step-1", state), state)
    assert ops.verify_checkpoint(f"{root}/step-1").ok
    report = ops.gc(str(root), min_age=0)
    assert any(k.startswith(references.PINS_DIR) for k in report.objects)
    assert any(k.startswith("step-2/") for k in report.objects)
    assert ops.verify_checkpoint(f"{root}/step-1").ok


def test_incremental_refuses_local_tier_and_a_given_base(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="local_tier"):
        dcpstore.Checkpointer(str(tmp_path / "r"), incremental=True,
                              local_tier=str(tmp_path / "l"))
    with pytest.raises(ValueError, match="base="):
        dcpstore.Checkpointer(str(tmp_path / "r"), base=str(tmp_path / "r" / "step-1"))


# -- 2 ranks, FSDP2 with frozen and trainable parts -----------------------------------------


@pytest.mark.parametrize("store", ["local", "seaweedfs"], indirect=True)
def test_fsdp2_incremental_resume_from_every_step(store: Store) -> None:
    root = store.uri("run")
    out = run_ranks(save_steps, 2, root, 4, 3, store.options)
    saved, retained = out[0]["saved"], out[0]["retained"]
    assert retained == [2, 3, 4]
    for rank in out:
        assert rank["exact"] == {s: "" for s in retained}, rank["exact"]

    assert list(out[0]["hinted"]) == ["app.model.blocks.0.bias", "app.model.blocks.0.weight",
                                      "app.model.inp.bias", "app.model.inp.weight"]
    # frozen parameters are referenced from the step that wrote them, trainable ones not
    for step in (3, 4):
        uri = f"{root}/step-{step:09d}"
        md = load_metadata(dcpstore.open_backend(uri, **store.options))[0]
        for index, info in md.storage_data.items():
            name = index.fqn.removeprefix("app.model.")
            if index.fqn == "app.model.blocks.0.weight":  # frozen, 18 KiB per shard
                assert info.relative_path.startswith("../step-000000001/"), index.fqn
            elif index.fqn.startswith("app.model.") and not name.startswith(FROZEN):
                assert not info.relative_path.startswith(".."), index.fqn
        assert ops.verify_checkpoint(uri, **store.options).ok
        assert ops.inspect_checkpoint(uri, **store.options)["referenced_bytes"] > 0

    # another world size
    loaded = run_ranks(load_steps, 1, root, retained, store.options)[0]
    for step in retained:
        assert_state_equal(loaded[step], saved[step])


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_async_incremental_saves(tmp_path: Path, mode: str) -> None:
    root = tmp_path / "run"
    state = lora_state()
    with dcpstore.Checkpointer(str(root), incremental=True, async_mode=mode) as ckpt:
        for step in (1, 2, 3):
            advance(state)
            ckpt.save(step, state)
        ckpt.wait()
        out = zeros_like(state)
        ckpt.load(out, step=3)
    assert_state_equal(out, state)
    paths = paths_of(ckpt.step_uri(3))
    assert all(paths[k].startswith("../step-000000001/") for k in BASE_KEYS)
    assert not paths["lora.a"].startswith("..")
