"""The command line, run as a subprocess.

Each ``run_cli`` command is a fresh process of its own, forked from one that imported
torch and dcpstore once (:class:`cli_fork.ForkedCLI`): ``python -m dcpstore ARGS`` without paying
torch's import per command. The tests of how a real process starts and ends (a closed
stdout pipe, a pipe into ``head``) run ``python -m dcpstore`` itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_fork import ForkedCLI

_cli: ForkedCLI | None = None


@pytest.fixture(scope="module", autouse=True)
def _forked_cli() -> Iterator[None]:
    global _cli
    with ForkedCLI() as server:
        _cli = server
        yield
    _cli = None


def run_cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    assert _cli is not None
    proc = _cli.run(*args)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def test_demo_local(tmp_path: Path) -> None:
    uri = str(tmp_path / "demo" / "step-3")
    proc = run_cli("demo", "--uri", uri, "--width", "128")
    assert "bit-exact" in proc.stdout
    assert "MB/s" in proc.stdout
    assert (tmp_path / "demo" / "step-3" / ".metadata").exists()
    assert "Traceback" not in proc.stderr


def test_demo_json(tmp_path: Path) -> None:
    proc = run_cli("--json", "demo", "--uri", str(tmp_path / "d"), "--width", "64")
    result = json.loads(proc.stdout)
    assert result["bit_exact"] is True and result["files"] == 2


def test_errors_are_one_line_without_traceback(tmp_path: Path) -> None:
    proc = run_cli("demo", "--uri", "nosuchscheme://b/x", check=False)
    assert proc.returncode == 1
    assert proc.stderr.startswith("dcpstore: error: BackendNotFoundError: unknown storage scheme")
    assert len(proc.stderr.strip().splitlines()) == 1


import torch  # noqa: E402

import dcpstore  # noqa: E402


@pytest.fixture
def run_root(tmp_path: Path) -> Path:
    ckpt = dcpstore.Checkpointer(str(tmp_path / "run"))
    for step in (1, 2):
        ckpt.save(
            step,
            {
                "w": torch.arange(1000.0) * step,
                "b": torch.ones(3, 4).bfloat16(),
                "meta": {"epoch": step},
            },
        )
    crashed = tmp_path / "run" / "step-000000003"
    crashed.mkdir()
    (crashed / "__0_0.0123456789abcdef.distcp").write_bytes(b"partial save")
    return tmp_path / "run"


def test_ls_human_and_json(run_root: Path) -> None:
    out = run_cli("ls", str(run_root)).stdout
    assert "step-000000001  committed" in out and "INCOMPLETE" in out
    rows = json.loads(run_cli("ls", str(run_root), "--json").stdout)
    assert [(r["step"], r["committed"]) for r in rows] == [(1, True), (2, True), (3, False)]
    assert rows[0]["world_size"] == 1


def test_inspect(run_root: Path) -> None:
    out = run_cli("inspect", str(run_root / "step-000000002")).stdout
    assert "w" in out and "float32" in out and "1000" in out and "bfloat16" in out
    info = json.loads(run_cli("--json", "inspect", str(run_root / "step-000000002")).stdout)
    keys = {k["key"]: k for k in info["keys"]}
    assert keys["w"]["shape"] == [1000] and keys["w"]["bytes"] == 4000
    assert keys["meta.epoch"]["kind"] == "object"
    assert info["world_size"] == 1 and info["torch_version"] == torch.__version__


def test_verify_ok_and_corrupted(run_root: Path) -> None:
    ckpt = run_root / "step-000000001"
    proc = run_cli("verify", str(ckpt))
    assert proc.stdout.startswith("OK:")
    (data,) = ckpt.glob("__*.distcp")
    raw = bytearray(data.read_bytes())
    raw[-200] ^= 0xFF
    data.write_bytes(bytes(raw))
    bad = run_cli("verify", str(ckpt), "--json", check=False)
    assert bad.returncode == 2
    report = json.loads(bad.stdout)
    assert report["ok"] is False
    assert data.name in report["errors"][0] and "CRC32C mismatch" in report["errors"][0]
    assert f"dcpstore: mismatch: {data.name}" in bad.stderr


def test_cp_then_rm_and_gc(run_root: Path, tmp_path: Path) -> None:
    dst = tmp_path / "copy" / "step-000000002"
    run_cli("cp", str(run_root / "step-000000002"), str(dst))
    out = {"w": torch.zeros(1000), "b": torch.zeros(3, 4).bfloat16(), "meta": {"epoch": 0}}
    dcpstore.load(out, dst)
    assert torch.equal(out["w"], torch.arange(1000.0) * 2) and out["meta"]["epoch"] == 2
    refused = run_cli("cp", str(run_root / "step-000000001"), str(dst), check=False)
    assert refused.returncode == 1 and "--overwrite" in refused.stderr

    dry = json.loads(run_cli("rm", str(dst), "--dry-run", "--json").stdout)
    assert ".metadata" in dry["deleted"] and (dst / ".metadata").exists()
    run_cli("rm", str(dst))
    assert not (dst / ".metadata").exists() and not list(dst.glob("*")) if dst.exists() else True
    missing = run_cli("rm", str(dst), check=False)
    assert missing.returncode == 1 and "CheckpointNotFoundError" in missing.stderr

    young = json.loads(run_cli("gc", str(run_root), "--json").stdout)
    assert young["objects"] == []  # in-progress saves (young files) are left alone
    plan = json.loads(run_cli("gc", str(run_root), "--min-age", "0", "--dry-run", "--json").stdout)
    assert plan["objects"] == ["step-000000003/__0_0.0123456789abcdef.distcp"]
    run_cli("gc", str(run_root), "--min-age", "0")
    assert dcpstore.Checkpointer(str(run_root)).steps() == [1, 2]
    assert not (run_root / "step-000000003").exists()


def test_export_and_bench(run_root: Path, tmp_path: Path) -> None:
    run_cli("export", str(run_root / "step-000000001"), str(tmp_path / "w.pt"))
    state = torch.load(tmp_path / "w.pt", weights_only=True)
    assert torch.equal(state["w"], torch.arange(1000.0))
    bench = json.loads(run_cli("bench", str(tmp_path / "b"), "--size-mb", "4", "--json").stdout)
    assert bench["bit_exact"] is True and bench["bytes"] == 4 * 1024 * 1024
    assert not any((tmp_path / "b").rglob(".metadata"))


def test_bad_uri_and_missing_checkpoint_are_one_line(tmp_path: Path) -> None:
    for args in (
        ["inspect", str(tmp_path / "none")],
        ["verify", "zzz://x/y"],
        ["ls", "s3://bucket/../x"],
    ):
        proc = run_cli(*args, check=False)
        assert proc.returncode == 1, args
        assert proc.stderr.startswith("dcpstore: error:") and "Traceback" not in proc.stderr
    debug = run_cli("--debug", "inspect", str(tmp_path / "none"), check=False)
    assert "Traceback" in debug.stderr


def test_closed_stdout_pipe_ends_quietly(run_root: Path) -> None:
    """``dcpstore inspect URI | head``: no BrokenPipeError, exit 141 like a Unix tool."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "dcpstore", "inspect", str(run_root / "step-000000002")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader goes away before the first line is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141, err
    assert err == ""


def test_shell_pipe_into_head(run_root: Path) -> None:
    ckpt = dcpstore.Checkpointer(str(run_root))
    ckpt.save(9, {f"key{i:05d}": torch.ones(1) for i in range(3000)})  # > a pipe buffer
    cmd = (f"{sys.executable} -m dcpstore inspect {run_root / 'step-000000009'} | head -n 2; "
           "exit ${PIPESTATUS[0]}")
    proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=300)
    assert proc.stdout.splitlines()[0].startswith("checkpoint")
    assert len(proc.stdout.splitlines()) == 2
    assert "Error" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 141


def test_json_has_no_progress_bar_unless_asked(run_root: Path) -> None:
    ckpt = str(run_root / "step-000000001")
    quiet = run_cli("verify", ckpt, "--json")
    assert json.loads(quiet.stdout)["ok"] is True
    assert quiet.stderr == ""
    asked = run_cli("--json", "verify", ckpt, "--progress")
    assert json.loads(asked.stdout)["ok"] is True
    assert "verify" in asked.stderr and "B/s" in asked.stderr
    hidden = run_cli("verify", ckpt, "--no-progress")
    assert hidden.stdout.startswith("OK:") and hidden.stderr == ""
