"""Golden corpus: checkpoints written by an earlier commit must keep loading, bit-exact.

``tests/golden/fb917c0/`` holds checkpoints that commit ``fb917c0`` wrote with
``tests/golden/make_golden.py`` on 2 gloo CPU ranks (see its ``README.md``):

- ``plain/``: one sharded ``dcpstore.save``;
- ``run/``: a ``dcpstore.Checkpointer(..., incremental=True)`` run whose step 2 references
  the unchanged tensors' bytes in step 1 (``../step-000000001/...``).

Every value is rebuilt here from ``arange`` and exact arithmetic; nothing is read but the
corpus. Only what users import is used (``dcpstore``'s top-level names, its command line
and torch), so the test survives refactors of dcpstore's modules. Each test loads a copy
in ``tmp_path``: nothing is written into the repository.

Never regenerate an existing corpus to make this test pass: a failure here means
checkpoints that users already have stopped loading.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import runpy
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcpstore

CORPUS = Path(__file__).parent / "golden" / "fb917c0"
STEP1 = "step-000000001"
STEP2 = "step-000000002"

# torch warns that DCP runs without a process group in single-process loads
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# -- the expected values: rebuilt by the functions that built the corpus -------------------
# (importing them keeps one definition; a change there that no longer matches the files
# written at fb917c0 fails here)

_spec = importlib.util.spec_from_file_location(
    "make_golden", Path(__file__).parent / "golden" / "make_golden.py")
assert _spec is not None and _spec.loader is not None
make_golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_golden)
ramp, plain_values, run_values = make_golden.ramp, make_golden.plain_values, make_golden.run_values


# -- helpers -------------------------------------------------------------------------------


def template(values: dict[str, Any]) -> dict[str, Any]:
    """A destination state for ``values``: tensors of the same shape and dtype filled with
    a value none of them holds everywhere, ``None`` in place of every other value (so a
    value that was not loaded cannot pass)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, torch.Tensor):
            out[key] = torch.full_like(value, 7)
        elif isinstance(value, dict):
            out[key] = template(value)
        else:
            out[key] = None
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (``-0.0`` and ``0.0`` differ here, unlike ``torch.equal``)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same(actual: Any, expected: Any, where: str = "") -> None:
    """Assert ``actual`` is ``expected``: tensors bit-exact with equal dtype and shape,
    other values equal and of the same type, recursively through dicts."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: {type(actual).__name__}"
        assert actual.dtype == expected.dtype, f"{where}: {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{where}: {actual.shape} != {expected.shape}"
        assert torch.equal(actual, expected), f"{where}: values differ"
        assert torch.equal(bits(actual), bits(expected)), f"{where}: bits differ"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{where}: {type(actual).__name__}"
        assert actual.keys() == expected.keys(), f"{where}: {sorted(actual)}"
        for key, value in expected.items():
            assert_same(actual[key], value, f"{where}.{key}".lstrip("."))
    else:
        assert type(actual) is type(expected), f"{where}: {type(actual).__name__}"
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def safe_plain_values() -> dict[str, Any]:
    """``plain_values`` without ``blob_io``: what loads with the default (safe) options."""
    values = plain_values()
    del values["blob_io"]
    return values


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """A private copy of the corpus (loads must never write into the repository)."""
    return Path(shutil.copytree(CORPUS, tmp_path / CORPUS.name))


# -- plain/ --------------------------------------------------------------------------------


def test_corpus_is_complete() -> None:
    """The corpus holds what the other tests expect (a missing file fails loudly here)."""
    names = {p.relative_to(CORPUS).as_posix() for p in CORPUS.rglob("*") if p.is_file()}
    for ckpt in ("plain", f"run/{STEP1}", f"run/{STEP2}"):
        assert f"{ckpt}/.metadata" in names
        assert any(n.startswith(f"{ckpt}/.dcpstore-") and n.endswith(".json") for n in names)
        assert any(n.startswith(f"{ckpt}/__") and n.endswith(".distcp") for n in names)


def test_plain_dcpstore_load(corpus: Path) -> None:
    """``dcpstore.load`` restores every value of ``plain/`` bit-exact."""
    expected = safe_plain_values()
    state = template(expected)
    dcpstore.load(state, str(corpus / "plain"))
    assert_same(state, expected)


def test_plain_get_reader_dcp_load(corpus: Path) -> None:
    """``dcp.load`` with ``dcpstore.get_reader`` restores ``plain/`` bit-exact."""
    expected = safe_plain_values()
    state = template(expected)
    dcp.load(state, storage_reader=dcpstore.get_reader(str(corpus / "plain")))
    assert_same(state, expected)


def test_plain_bytesio_needs_allow_pickle(corpus: Path) -> None:
    """DCP pickles an ``io.BytesIO`` whole: refused by default, restored with
    ``allow_pickle=True``."""
    uri = str(corpus / "plain")
    with pytest.raises(dcpstore.UnsafeCheckpointError):
        dcpstore.load({"blob_io": io.BytesIO()}, uri)
    state: dict[str, Any] = {"blob_io": io.BytesIO()}
    dcpstore.load(state, uri, allow_pickle=True)
    assert isinstance(state["blob_io"], io.BytesIO)
    assert state["blob_io"].getvalue() == plain_values()["blob_io"]


def test_plain_torch_reader(corpus: Path) -> None:
    """The layout stays DCP's own: torch's ``FileSystemReader`` loads ``plain/`` too."""
    expected = safe_plain_values()
    state = template(expected)
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(corpus / "plain")))
    assert_same(state, expected)


def test_plain_corrupted_payload_is_refused(corpus: Path) -> None:
    """A flipped byte in a stored payload is caught by the golden manifest's CRC32C."""
    expected = plain_values()["weight"]
    needle = expected[:32].numpy().tobytes()  # rank 0's Shard(0) chunk, as stored
    hits = [(p, p.read_bytes().find(needle)) for p in (corpus / "plain").glob("*.distcp")]
    hits = [(p, at) for p, at in hits if at >= 0]
    assert hits, "weight[:32] is stored in no data file (the corpus itself is damaged?)"
    path, at = hits[0]
    data = bytearray(path.read_bytes())
    data[at + len(needle) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(dcpstore.IntegrityError):
        dcpstore.load({"weight": torch.zeros(64, 16)}, str(corpus / "plain"))


# -- run/ ----------------------------------------------------------------------------------


def test_run_step2_references_step1() -> None:
    """Step 2 is incremental: part of its items point into step 1's files."""
    md = dcp.FileSystemReader(str(CORPUS / "run" / STEP2)).read_metadata()
    paths = {info.relative_path for info in (md.storage_data or {}).values()}
    assert any(p.startswith(f"../{STEP1}/") for p in paths), paths
    assert any("/" not in p for p in paths), paths  # and some it wrote itself


def test_run_checkpointer(corpus: Path) -> None:
    """``Checkpointer`` lists both steps, names step 2 latest and loads each bit-exact."""
    ckpt = dcpstore.Checkpointer(str(corpus / "run"))
    try:
        assert [int(s) for s in ckpt.steps()] == [1, 2]
        latest = ckpt.latest()
        assert latest is not None and int(latest) == 2
        for step in (None, 1, 2):
            expected = run_values(2 if step is None else step)
            state = template(expected)
            assert ckpt.load(state, step=step) == (2 if step is None else step)
            assert_same(state, expected, f"step {step}")
    finally:
        ckpt.close()


@pytest.mark.parametrize("step", [1, 2])
def test_run_step_dcpstore_load(corpus: Path, step: int) -> None:
    """Each step loads on its own through ``dcpstore.load`` (step 2 through its
    references into step 1)."""
    expected = run_values(step)
    state = template(expected)
    dcpstore.load(state, str(corpus / "run" / f"step-{step:09d}"))
    assert_same(state, expected)


def test_run_step2_get_reader_and_torch_reader(corpus: Path) -> None:
    """Step 2 loads through ``dcpstore.get_reader`` and through torch's own reader."""
    uri = str(corpus / "run" / STEP2)
    for reader in (dcpstore.get_reader(uri), dcp.FileSystemReader(uri)):
        expected = run_values(2)
        state = template(expected)
        dcp.load(state, storage_reader=reader)
        assert_same(state, expected, type(reader).__name__)


# -- dcpstore verify -----------------------------------------------------------------------


def run_cli(*args: str) -> tuple[int, str, str]:
    """Run ``python -m dcpstore ARGS`` in this process (no second torch import).

    Returns:
        The exit status, stdout and stderr.
    """
    out, err = io.StringIO(), io.StringIO()
    argv = sys.argv
    sys.argv = ["dcpstore", *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_module("dcpstore", run_name="__main__", alter_sys=False)
        code: Any = 0
    except SystemExit as exc:
        code = exc.code
    finally:
        sys.argv = argv
    return (code if isinstance(code, int) else 1), out.getvalue(), err.getvalue()


@pytest.mark.parametrize("ckpt", ["plain", f"run/{STEP1}", f"run/{STEP2}"])
def test_verify_cli(corpus: Path, ckpt: str) -> None:
    """``dcpstore verify`` finds every file whole (on step 2 following its references into
    step 1)."""
    code, out, err = run_cli("verify", str(corpus / ckpt), "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["ok"] and report["has_manifest"] and not report["errors"], report
    assert report["files"] == (4 if ckpt.endswith(STEP2) else 2), report


def test_verify_cli_reports_a_flipped_byte(corpus: Path) -> None:
    """``dcpstore verify`` exits 2 when a byte of a referenced step-1 file is flipped."""
    path = sorted((corpus / "run" / STEP1).glob("*.distcp"))[-1]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    code, _, err = run_cli("verify", str(corpus / "run" / STEP2), "--json")
    assert code == 2, err
    assert "mismatch" in err, err


# -- world size 2 --------------------------------------------------------------------------


def _load_at_two_ranks(rank: int, world_size: int, root: str) -> bool:
    """On each of 2 ranks: load ``plain/`` and the run's latest step into DTensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    placements: dict[str, list[Placement]] = {
        "weight": [Shard(0)], "norm_bf16": [Replicate()], "frozen": [Shard(0)],
        "adapter": [Shard(1)],  # saved as Shard(0): loading it is a reshard
    }

    def dtensors(values: dict[str, Any]) -> dict[str, Any]:
        state = template(values)
        for key, place in placements.items():
            if key in state:
                state[key] = distribute_tensor(state[key], mesh, place)
        return state

    expected = safe_plain_values()
    state = dtensors(expected)
    dcpstore.load(state, os.path.join(root, "plain"))
    for key in placements.keys() & state.keys():
        state[key] = state[key].full_tensor()
    assert_same(state, expected, f"plain, rank {rank}")

    expected = run_values(2)
    state = dtensors(expected)
    ckpt = dcpstore.Checkpointer(os.path.join(root, "run"))
    assert ckpt.load(state) == 2
    ckpt.close()
    for key in placements.keys() & state.keys():
        state[key] = state[key].full_tensor()
    assert_same(state, expected, f"run step 2, rank {rank}")
    return True


@pytest.mark.multiprocess
def test_load_at_world_size_2(corpus: Path) -> None:
    """The corpus loads into DTensors on 2 gloo ranks, bit-exact on every rank."""
    from mp import run_ranks

    assert run_ranks(_load_at_two_ranks, 2, str(corpus)) == [True, True]
