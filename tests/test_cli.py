"""The command line, run as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def run_cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "dcpstore", *args], capture_output=True,
                          text=True, timeout=300)
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
