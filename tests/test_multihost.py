"""dcpstore on several hosts (issue 32): each host a network namespace with its own
address, ``TMPDIR`` and local-tier directory on a private bridge
(:mod:`dcpstore.testing.hosts`); every job is ``torchrun`` per host with a c10d
rendezvous over that network; SeaweedFS listens on the machine's side of the bridge.

Covered here: a save on 2 hosts x 2 ranks loads bit-exact on 1 host x 3 ranks and on
3 hosts x 1 rank, reads shared across hosts (read once); ``Checkpointer`` thread and
process modes with retention and the latest pointer, and incremental saves, on 2 x 2;
every process of one host SIGKILLed in the middle of a save.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from multihost_workers import full_state

import dcpstore
from dcpstore.testing.hosts import Hosts, sweep
from dcpstore.testing.servers import S3Server, isolate_env, seaweedfs_server
from dcpstore.training.latest import step_dir

WORKERS = str(Path(__file__).with_name("multihost_workers.py"))
BUCKET = "multihost"
#: Seconds a job may take before it counts as hung.
JOB_TIMEOUT = 240

@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    """Three hosts for the whole module (a test uses the first 1 to 3). Needs root and
    iproute2 (``make setup`` installs it): without them this fails, saying so."""
    sweep()
    with Hosts(3) as made:
        yield made


@pytest.fixture(scope="module")
def bridge_s3(hosts: Hosts) -> Iterator[S3Server]:
    """SeaweedFS on the machine's side of the hosts' bridge."""
    with seaweedfs_server(bucket=BUCKET, address=hosts.gateway) as server:
        yield server


@pytest.fixture
def s3(bridge_s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    isolate_env(monkeypatch, extra=bridge_s3.env())
    return bridge_s3


def _options(server: S3Server) -> dict[str, Any]:
    return {"endpoint_url": server.endpoint_url}


def _job(hosts: Hosts, tmp_path: Path, op: str, args: dict[str, Any], *, nhosts: int,
         nproc: int) -> list[dict[str, Any]]:
    """Run ``op`` on ``nhosts`` hosts x ``nproc`` ranks; every rank's record, by rank."""
    out = tmp_path / f"{op}-{uuid.uuid4().hex[:6]}"
    out.mkdir()
    script = [WORKERS, op, json.dumps({**args, "out": str(out)})]
    procs = hosts.torchrun(script, nproc_per_host=nproc, hosts=hosts.hosts[:nhosts],
                           logs=str(out / "logs"))
    _wait(procs, out)
    return _records(out, op, nhosts * nproc)


def _wait(procs: list[subprocess.Popen[bytes]], out: Path) -> None:
    deadline = time.monotonic() + JOB_TIMEOUT
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"the job hung; logs: {_logs(out)}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()


def _logs(out: Path) -> str:
    logs = sorted((out / "logs").glob("*.log"))
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs)


def _records(out: Path, op: str, world: int) -> list[dict[str, Any]]:
    records = []
    for rank in range(world):
        path = out / f"{op}-rank{rank}.json"
        assert path.exists(), f"rank {rank} reported nothing; logs:\n{_logs(out)}"
        records.append(json.loads(path.read_text()))
    failed = [r for r in records if r["status"] != "ok"]
    assert not failed, "\n".join(f"rank {r['rank']} (host {r['host']}): {r['traceback']}"
                                 for r in failed)
    return records


def _hosts_of(records: list[dict[str, Any]]) -> dict[int, list[int]]:
    by_host: dict[int, list[int]] = {}
    for r in records:
        by_host.setdefault(r["host"], []).append(r["rank"])
    return by_host


def test_save_on_2x2_loads_on_1x3_and_3x1(hosts: Hosts, s3: S3Server, tmp_path: Path) -> None:
    uri = f"s3://{BUCKET}/reshard-{uuid.uuid4().hex[:8]}"
    saved = _job(hosts, tmp_path, "save", {"uri": uri, "step": 7, "options": _options(s3)},
                 nhosts=2, nproc=2)
    assert len(_hosts_of(saved)) == 2 and all(len(r) == 2 for r in _hosts_of(saved).values())
    for nhosts, nproc in ((1, 3), (3, 1)):
        # read once, shared: the replicated items are fetched by one rank, sent to the
        # others over the job's process group, across hosts
        loaded = _job(hosts, tmp_path, "load",
                      {"uri": uri, "step": 7,
                       "options": {**_options(s3), "broadcast_reads": True}},
                      nhosts=nhosts, nproc=nproc)
        assert len(_hosts_of(loaded)) == nhosts
        assert all(r["mismatched"] == [] for r in loaded), (nhosts, nproc, loaded)
    # and here, without a process group: the whole state, bit-exact
    full = {k: torch.zeros_like(v) for k, v in _full(7).items()}
    dcpstore.load(full, uri, **_options(s3))
    assert all(torch.equal(full[k], v) for k, v in _full(7).items())


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_checkpointer_modes_retention_and_latest(hosts: Hosts, s3: S3Server, tmp_path: Path,
                                                 mode: str) -> None:
    root = f"s3://{BUCKET}/ckpt-{mode}-{uuid.uuid4().hex[:8]}"
    records = _job(hosts, tmp_path, "checkpointer",
                   {"root": root, "mode": mode, "options": _options(s3)}, nhosts=2, nproc=2)
    for r in records:
        assert (r["latest"], r["steps"], r["loaded"], r["mismatched"]) == (4, [3, 4], 4, []), r


def test_incremental_saves(hosts: Hosts, s3: S3Server, tmp_path: Path) -> None:
    root = f"s3://{BUCKET}/incr-{uuid.uuid4().hex[:8]}"
    records = _job(hosts, tmp_path, "checkpointer",
                   {"root": root, "mode": None, "incremental": True, "options": _options(s3)},
                   nhosts=2, nproc=2)
    for r in records:
        assert (r["latest"], r["steps"], r["loaded"], r["mismatched"]) == (4, [3, 4], 4, []), r


@pytest.mark.parametrize("mode", [None, "thread"])
def test_one_host_killed_during_a_save(hosts: Hosts, s3: S3Server, tmp_path: Path,
                                       mode: str | None) -> None:
    """Every process of host 1 is SIGKILLed while step 2 is being written (its link is
    slowed so that the save is in flight): step 1 stays the latest and loads bit-exact;
    step 2 is never listed; host 0's ranks fail within the group's timeout instead of
    hanging, in blocking and in thread mode."""
    root = f"s3://{BUCKET}/killed-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "killed"
    out.mkdir()
    args = {"root": root, "scale": 128, "options": _options(s3), "out": str(out),
            "pg_timeout": 20, "mode": mode}
    hosts.throttle(hosts[1], 16)  # 2 MB/s out of host 1: step 2 takes seconds
    try:
        procs = hosts.torchrun([WORKERS, "killed_save", json.dumps(args)], nproc_per_host=2,
                               hosts=hosts.hosts[:2], logs=str(out / "logs"))
        try:
            deadline = time.monotonic() + JOB_TIMEOUT
            while not (out / "step2-started").exists():
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                    _logs(out)
                time.sleep(0.05)
            time.sleep(0.5)  # step 2's data is on its way
            hosts.kill_host(hosts[1], procs[1])
            # host 0's ranks report a failure (torchrun itself would then wait for the
            # dead host at its exit barrier: it is not waited for)
            survivors = [out / f"killed_save-rank{r}.json" for r in (0, 1)]
            while not all(p.exists() for p in survivors):
                assert time.monotonic() < deadline, f"host 0 hung:\n{_logs(out)}"
                time.sleep(0.2)
        finally:
            for host, proc in zip(hosts.hosts[:2], procs, strict=True):
                hosts.kill_host(host, proc)
    finally:
        hosts.unthrottle(hosts[1])
    for path in survivors:
        record = json.loads(path.read_text())
        assert record["status"] == "error", record
    assert not (out / "killed_save-rank2.json").exists()  # host 1 died before reporting
    ckpt = dcpstore.Checkpointer(root, **_options(s3))
    try:
        assert [int(s) for s in ckpt.steps()] == [1]
        assert ckpt.latest() == 1
        full = {k: torch.zeros_like(v) for k, v in _full(1).items()}
        assert ckpt.load(full) == 1
    finally:
        ckpt.close()
    assert all(torch.equal(full[k], v) for k, v in _full(1).items())


def test_node_local_tier_resumes_each_host_from_its_own_disk(
        hosts: Hosts, s3: S3Server, tmp_path: Path) -> None:
    """2 hosts x 2 ranks with a tier on each host's own disk. Every host gets the commit
    record; a restart loads from the tier although no host holds another host's files
    (the replicated items, written by one rank, reach the others over the process group).
    A host whose copy of a file is not the committed one is ignored, and then the step
    is on no host whole: it loads from the root."""
    name = f"tier-{uuid.uuid4().hex[:8]}"
    args = {"root": f"s3://{BUCKET}/{name}", "name": name, "options": _options(s3),
            "replicas": 0}
    saved = _job(hosts, tmp_path, "tier", {**args, "phase": "save"}, nhosts=2, nproc=2)
    step_dirs = {h: Path(hosts[h].tier) / name / step_dir(2) for h in (0, 1)}
    for host, ranks in _hosts_of(saved).items():
        names = sorted(p.name for p in step_dirs[host].iterdir())
        assert ".metadata" in names and any(n.startswith(".dcpstore-") for n in names), names
        owners = {int(n.split("_")[2]) for n in names if n.startswith("__")}
        assert owners == set(ranks), (host, names)  # its own ranks' files alone

    loaded = _job(hosts, tmp_path, "tier", {**args, "phase": "load"}, nhosts=2, nproc=2)
    assert all((r["loaded"], r["where"], r["mismatched"]) == (2, "local", []) for r in loaded), \
        loaded

    victim = next(p for p in step_dirs[1].iterdir() if p.name.startswith("__"))
    victim.write_bytes(victim.read_bytes()[:-1])  # not the committed copy any more
    loaded = _job(hosts, tmp_path, "tier", {**args, "phase": "load"}, nhosts=2, nproc=2)
    assert all((r["loaded"], r["where"], r["mismatched"]) == (2, "remote", []) for r in loaded), \
        loaded


def test_node_local_tier_replicas_survive_losing_a_host(
        hosts: Hosts, s3: S3Server, tmp_path: Path) -> None:
    """3 hosts x 2 ranks, one replica (the default): each host's files are copied to the
    next host in the background, so each file is on exactly two hosts. Host 1 then loses
    its disk; the restart loads every rank from the tier, host 1's files from the host
    holding their copies, bit-exact."""
    name = f"replicas-{uuid.uuid4().hex[:8]}"
    args = {"root": f"s3://{BUCKET}/{name}", "name": name, "options": _options(s3)}
    saved = _job(hosts, tmp_path, "tier", {**args, "phase": "save"}, nhosts=3, nproc=2)
    for r in saved:
        copied = r["replication"]
        assert copied["step"] == 2 and copied["errors"] == [], copied
        assert copied["files_received"] > 0 and copied["bytes_sent"] > 0, copied
    step_dirs = [Path(hosts[h].tier) / name / step_dir(2) for h in range(3)]
    where: dict[str, list[int]] = {}
    for host, path in enumerate(step_dirs):
        names = [p.name for p in path.iterdir()]
        assert not any(n.endswith(".tmp") for n in names), names
        for n in names:
            if n.startswith("__"):
                where.setdefault(n, []).append(host)
    ranks_of = _hosts_of(saved)
    for n, at in where.items():
        origin = next(h for h, ranks in ranks_of.items() if int(n.split("_")[2]) in ranks)
        assert sorted(at) == sorted({origin, (origin + 1) % 3}), (n, at)  # K+1 copies

    shutil.rmtree(Path(hosts[1].tier) / name)  # host 1 is replaced: an empty disk
    loaded = _job(hosts, tmp_path, "tier", {**args, "phase": "load"}, nhosts=3, nproc=2)
    assert all((r["loaded"], r["where"], r["mismatched"]) == (2, "local", []) for r in loaded), \
        loaded
    assert (step_dirs[1] / ".metadata").is_file()  # the new host got the commit record


def _full(step: int) -> dict[str, torch.Tensor]:
    return full_state(step)


# -- the hosts themselves ------------------------------------------------------------------

_CONNECT = ("import socket, sys\n"
            "try:\n"
            "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()\n"
            "    print('reached')\n"
            "except OSError as exc:\n"
            "    print(type(exc).__name__)\n")


def _connect_from(hosts: Hosts, host: int, address: str, port: int) -> str:
    proc = hosts.popen(hosts[host], [sys.executable, "-c", _CONNECT, address, str(port)],
                       stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=30)
    return out.decode().strip()


def test_hosts_reach_each_other_and_nothing_else(hosts: Hosts) -> None:
    listener = hosts.popen(hosts[0], [sys.executable, "-c", (
        "import socket, sys, time\n"
        "s = socket.create_server((sys.argv[1], 0)); print(s.getsockname()[1], flush=True)\n"
        "while True:\n    c, _ = s.accept(); c.close()\n"), hosts[0].address],
        stdout=subprocess.PIPE)
    try:
        assert listener.stdout is not None
        port = int(listener.stdout.readline())
        assert _connect_from(hosts, 1, hosts[0].address, port) == "reached"
        hosts.cut(hosts[1])  # a lost node: its link is down
        assert _connect_from(hosts, 1, hosts[0].address, port) != "reached"
        hosts.restore(hosts[1])
        assert _connect_from(hosts, 1, hosts[0].address, port) == "reached"
        # off the bridge there is no route (TEST-NET-1: nothing is sent)
        assert _connect_from(hosts, 1, "192.0.2.1", 80) == "OSError"
    finally:
        hosts.kill_host(hosts[0], listener)


def test_hosts_are_removed_after_a_failure_and_sweep_removes_a_dead_runs() -> None:
    made = Hosts(2)
    with pytest.raises(RuntimeError, match="a failed test"), made:
        names = [h.namespace for h in made.hosts]
        assert set(names) <= set(subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                text=True, check=True).stdout.split())
        raise RuntimeError("a failed test")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                            check=True).stdout
    assert not any(n in listed for n in names) and not os.path.exists(made.workdir)
    assert not any(os.path.exists(f"/etc/netns/{n}") for n in names)
    # what a killed run left: its maker's pid is gone
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"dcph{dead.pid}x0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    assert stale in sweep()
    assert stale not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                       text=True, check=True).stdout
