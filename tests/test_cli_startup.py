"""The CLI starts without torch where it needs none (issue 28): ``dcpstore --help`` and
``dcpstore ls`` on a local root. Each check runs the CLI in a fresh interpreter under
``-X importtime`` and reads the modules it imported from that report."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def imported_by_cli(cwd: Path, *args: str) -> tuple[set[str], subprocess.CompletedProcess[str]]:
    """The modules ``python -m dcpstore ARGS`` run in ``cwd`` imports (``-X importtime``),
    and its run. ``cwd`` is not the repository's root, so ``dcpstore`` comes from where
    it is installed, as for the ``dcpstore`` command."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("DCPSTORE_DCP_ROUTING", "PYTHONPROFILEIMPORTTIME")}  # the .pth hook
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "dcpstore", *args],
                          capture_output=True, text=True, timeout=120, env=env, cwd=cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert lines, proc.stderr  # the report is there: an empty set would prove nothing
    modules = {line.rpartition("|")[2].strip() for line in lines}
    return modules, proc


def torch_modules(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m == "torch" or m.startswith("torch."))


@pytest.mark.parametrize("args", [["--help"], ["ls", "--help"], ["verify", "--help"]])
def test_help_does_not_import_torch(args: list[str], tmp_path: Path) -> None:
    modules, proc = imported_by_cli(tmp_path, *args)
    assert "usage: dcpstore" in proc.stdout
    assert "dcpstore.tools.cli" in modules
    assert torch_modules(modules) == []


@pytest.fixture(scope="module")
def run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two committed steps and one incomplete save (made in this process: the CLI runs in
    a fresh one)."""
    import torch

    import dcpstore

    root = tmp_path_factory.mktemp("startup") / "run"
    ckpt = dcpstore.Checkpointer(str(root))
    for step in (1, 2):
        ckpt.save(step, {"w": torch.arange(100.0) * step, "meta": {"epoch": step}})
    ckpt.close()
    crashed = root / "step-000000003"
    crashed.mkdir()
    (crashed / "__0_0.0123456789abcdef.distcp").write_bytes(b"partial")
    return root


def test_ls_local_root_does_not_import_torch(run_root: Path) -> None:
    modules, proc = imported_by_cli(run_root, "ls", str(run_root))
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["CHECKPOINT", "STATE", "STEP", "SIZE", "FILES", "RANKS",
                                "DATE"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert set(rows) == {"step-000000001", "step-000000002", "step-000000003"}
    assert rows["step-000000002"][1:3] == ["committed", "2"]
    assert rows["step-000000002"][5] == "1"  # RANKS: read from the step's manifest
    assert rows["step-000000003"][1] == "INCOMPLETE"
    assert "dcpstore.tools.ops" in modules
    assert torch_modules(modules) == []


def test_the_check_sees_torch_where_a_command_needs_it(run_root: Path) -> None:
    """``inspect`` reads dtypes from the unpickled ``.metadata``: torch is imported, and
    the check above would see it."""
    modules, proc = imported_by_cli(run_root, "inspect", str(run_root / "step-000000002"))
    assert "checkpoint" in proc.stdout
    assert "torch" in modules
