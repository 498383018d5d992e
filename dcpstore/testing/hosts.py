"""Several hosts on one machine: Linux network namespaces on a private bridge.

Each :class:`Host` is a network namespace with its own address on a bridge that only
this machine has (``10.<a>.<b>.0/24``, chosen unused), its own directories (a local
tier, a ``TMPDIR``) and its own loopback. A process started on it (:meth:`Hosts.popen`,
:meth:`Hosts.torchrun`) sees the other hosts and the machine's side of the bridge
(:attr:`Hosts.gateway`: bind a server there to reach it from every host) and nothing
else. :meth:`Hosts.cut` takes a host's link down and :meth:`Hosts.throttle` slows it
(``tc tbf``), to test a lost or a slow node.

Needs root and ``iproute2`` (``ip``, ``tc``). Everything made is removed on exit, after
a failed test too; :func:`sweep` removes what a killed test run left.

    with Hosts(2) as hosts:
        procs = hosts.torchrun(module_argv, nproc_per_host=2, env=...)
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import logging
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from dcpstore.testing.servers import free_port

__all__ = ["Host", "Hosts", "available", "run_rank_op", "sweep"]

logger = logging.getLogger(__name__)

#: Names this module gives to namespaces and links: ``dcph<pid><a>x<i>``,
#: ``dcpb<pid><a>``, ``dcpv<pid><a>x<i>`` (the pid of the process that made them, for
#: :func:`sweep`; a letter per :class:`Hosts` of that process).
_PREFIXES = ("dcph", "dcpb", "dcpv")
#: The interface name inside each host.
IFNAME = "eth0"
_INSTANCES = itertools.count()


def available() -> str | None:
    """Why hosts cannot be made here (``None``: they can)."""
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed: make setup installs it"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


@dataclass(frozen=True)
class Host:
    """One host.

    Attributes:
        index: 0, 1, ...
        namespace: Its network namespace.
        address: Its address on the bridge.
        root: Its own directory on the machine (``tier/``, ``tmp/`` below it).
    """

    index: int
    namespace: str
    address: str
    root: str

    @property
    def tier(self) -> str:
        """Its local-tier directory (node-local disk)."""
        return os.path.join(self.root, "tier")

    @property
    def tmp(self) -> str:
        """Its ``TMPDIR``."""
        return os.path.join(self.root, "tmp")


class Hosts:
    """``count`` hosts on a private bridge (see the module docstring).

    Args:
        count: How many hosts (2 to 8).
        workdir: Where the hosts' directories go (default: a fresh temporary one,
            removed on exit).
    """

    def __init__(self, count: int, *, workdir: str | None = None) -> None:
        if not 1 <= count <= 8:
            raise ValueError(f"1 to 8 hosts, not {count}")
        reason = available()
        if reason:
            raise RuntimeError(f"cannot make hosts: {reason}")
        self.count = count
        self._own_workdir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="dcpstore-hosts-")
        # the maker's pid (for sweep), and a letter per Hosts of this process
        tag = f"{os.getpid()}{chr(97 + next(_INSTANCES) % 26)}"
        self.bridge = f"dcpb{tag}"[:15]
        self._tag = tag
        self.network = _free_network()
        first = self.network.network_address
        #: The machine's address on the bridge: servers every host reaches bind here.
        self.gateway = str(first + 1)
        self.hosts = [Host(i, f"dcph{tag}x{i}", str(first + 11 + i),
                           os.path.join(self.workdir, f"host{i}")) for i in range(count)]
        self._made: list[tuple[str, str]] = []  # ("netns" | "link", name), to undo

    def __enter__(self) -> Hosts:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    # -- making and removing ---------------------------------------------------------

    def _make(self) -> None:
        prefix = self.network.prefixlen
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _ip("addr", "add", f"{self.gateway}/{prefix}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for host in self.hosts:
            os.makedirs(host.tier, exist_ok=True)
            os.makedirs(host.tmp, exist_ok=True)
            _ip("netns", "add", host.namespace)
            self._made.append(("netns", host.namespace))
            veth = f"dcpv{self._tag}x{host.index}"[:15]
            _ip("link", "add", veth, "type", "veth", "peer", "name", IFNAME,
                "netns", host.namespace)
            self._made.append(("link", veth))
            _ip("link", "set", veth, "master", self.bridge, "up")
            ns = ("-n", host.namespace)
            _ip(*ns, "addr", "add", f"{host.address}/{prefix}", "dev", IFNAME)
            _ip(*ns, "link", "set", IFNAME, "up")
            _ip(*ns, "link", "set", "lo", "up")
            # no default route: an address off the bridge fails at once, and goes nowhere
            self._name_service(host)

    def _name_service(self, host: Host) -> None:
        """``/etc/hosts`` and an empty ``resolv.conf`` of the host's own (``ip netns
        exec`` mounts ``/etc/netns/<namespace>/*`` over ``/etc``): the hosts' names and
        this machine's hostname resolve on the bridge, and no DNS server is asked (a
        reverse lookup would otherwise wait for one that is out of reach)."""
        etc = os.path.join("/etc/netns", host.namespace)
        os.makedirs(etc, exist_ok=True)
        self._made.append(("etc", etc))
        lines = ["127.0.0.1 localhost", f"{host.address} {socket.gethostname()}",
                 f"{self.gateway} gateway"]
        lines += [f"{h.address} host{h.index}" for h in self.hosts]
        with open(os.path.join(etc, "hosts"), "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(os.path.join(etc, "resolv.conf"), "w") as f:
            f.write("# no DNS on the hosts' bridge\n")

    def close(self) -> None:
        """Remove every namespace and link made (each once; a missing one is fine)."""
        for kind, name in reversed(self._made):
            if kind == "netns":
                _ip("netns", "del", name, check=False)
            elif kind == "etc":
                shutil.rmtree(name, ignore_errors=True)
            else:
                _ip("link", "del", name, check=False)
        self._made.clear()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # -- processes -------------------------------------------------------------------

    def environ(self, host: Host, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of a process on ``host``: ``env`` (default this process's),
        its own ``TMPDIR``, gloo bound to its interface, and ``DCPSTORE_TEST_HOST``."""
        out = dict(os.environ if env is None else env)
        out.update(TMPDIR=host.tmp, GLOO_SOCKET_IFNAME=IFNAME, DCPSTORE_TEST_HOST=str(host.index),
                   DCPSTORE_TEST_TIER=host.tier)
        # no proxy: every address here is the bridge's
        for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
            out.pop(name, None)
        out["NO_PROXY"] = out["no_proxy"] = "*"
        return out

    def popen(self, host: Host, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              **kwargs: Any) -> subprocess.Popen[bytes]:
        """Start ``argv`` on ``host`` (in a session of its own)."""
        return subprocess.Popen(["ip", "netns", "exec", host.namespace, *argv],
                                env=self.environ(host, env), start_new_session=True, **kwargs)

    def torchrun(self, script: Sequence[str], *, nproc_per_host: int,
                 hosts: Sequence[Host] | None = None, env: Mapping[str, str] | None = None,
                 logs: str | None = None) -> list[subprocess.Popen[bytes]]:
        """One ``torchrun`` per host, meeting in a c10d rendezvous on the first host.

        Args:
            script: The script and its arguments (``[path, arg, ...]``).
            nproc_per_host: Ranks per host.
            hosts: The hosts that take part (default: all).
            env: Their environment (default this process's).
            logs: A directory for each host's output (``host<i>.log``).

        Returns:
            The ``torchrun`` processes, in the order of ``hosts``.
        """
        chosen = list(self.hosts if hosts is None else hosts)
        port = free_port()
        procs = []
        for host in chosen:
            argv = [sys.executable, "-m", "torch.distributed.run",
                    f"--nnodes={len(chosen)}", f"--nproc-per-node={nproc_per_host}",
                    "--rdzv-backend=c10d", f"--rdzv-endpoint={chosen[0].address}:{port}",
                    f"--rdzv-id=dcpstore-{port}", f"--local-addr={host.address}",
                    "--max-restarts=0", "--monitor-interval=0.5", *script]
            out: Any = subprocess.DEVNULL
            if logs is not None:
                os.makedirs(logs, exist_ok=True)
                out = open(os.path.join(logs, f"host{host.index}.log"), "ab")  # noqa: SIM115
            try:
                procs.append(self.popen(host, argv, env=env, stdout=out,
                                        stderr=subprocess.STDOUT))
            finally:
                if logs is not None:
                    out.close()
        return procs

    def kill_host(self, host: Host, *procs: subprocess.Popen[bytes]) -> None:
        """SIGKILL every process on ``host`` (a host lost at once: ``torchrun`` starts
        its workers in sessions of their own, so the namespace's process list is what
        finds them all), then reap ``procs``."""
        for _ in range(3):  # a process forked meanwhile is found on the next pass
            pids = _ip("netns", "pids", host.namespace, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            if not pids:
                break
        for proc in procs:
            proc.wait()

    # -- the network -----------------------------------------------------------------

    def cut(self, host: Host) -> None:
        """Take ``host``'s link down (the node is lost to the others)."""
        _ip("link", "set", f"dcpv{self._tag}x{host.index}"[:15], "down")

    def restore(self, host: Host) -> None:
        """Bring ``host``'s link back up."""
        _ip("link", "set", f"dcpv{self._tag}x{host.index}"[:15], "up")

    def unthrottle(self, host: Host) -> None:
        """Remove :meth:`throttle`'s limit."""
        subprocess.run(["ip", "netns", "exec", host.namespace, "tc", "qdisc", "del", "dev",
                        IFNAME, "root"], check=False, capture_output=True)

    def throttle(self, host: Host, mbit: float) -> None:
        """Limit what ``host`` sends to ``mbit`` Mbit/s (``tc tbf`` on its interface)."""
        subprocess.run(["ip", "netns", "exec", host.namespace, "tc", "qdisc", "replace",
                        "dev", IFNAME, "root", "tbf", "rate", f"{mbit}mbit", "burst",
                        "256kb", "latency", "200ms"], check=True, capture_output=True)


    def throttle_gateway(self, mbit: float) -> None:
        """Limit what the machine's side of the bridge sends to the hosts (a server bound
        to :attr:`gateway`: a remote store's downloads) to ``mbit`` Mbit/s in all. The
        hosts' traffic to each other is bridged, not sent by the machine: unaffected."""
        subprocess.run(["tc", "qdisc", "replace", "dev", self.bridge, "root", "tbf", "rate",
                        f"{mbit}mbit", "burst", "1mb", "latency", "200ms"], check=True,
                       capture_output=True)

    def unthrottle_gateway(self) -> None:
        """Remove :meth:`throttle_gateway`'s limit."""
        subprocess.run(["tc", "qdisc", "del", "dev", self.bridge, "root"], check=False,
                       capture_output=True)


def run_rank_op(ops: Mapping[str, Callable[[dict[str, Any]], dict[str, Any]]],
                argv: Sequence[str] | None = None) -> NoReturn:
    """The body of a rank that :meth:`Hosts.torchrun` starts: ``<op> <json args>``.

    Joins the gloo group (its timeout: ``args["pg_timeout"]``, default 180 s, so a rank
    whose peers' host is gone fails instead of waiting 30 minutes), runs ``ops[op](args)``
    and writes ``<args["out"]>/<op>-rank<rank>.json``: ``status`` ``"ok"`` with the op's
    record, or ``"error"`` with the error and its traceback, plus the rank, the world
    size, the host (``DCPSTORE_TEST_HOST``) and the local rank. Leaves with ``os._exit``
    (gloo can abort at interpreter exit); a rank stuck anyway dumps where, and goes.
    """
    import faulthandler
    import json
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    op, raw = (sys.argv[1:3] if argv is None else argv)
    args = json.loads(raw)
    timeout = args.get("pg_timeout", 180)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    faulthandler.dump_traceback_later(2 * timeout + 30, exit=True)
    rank = dist.get_rank()
    record: dict[str, Any] = {"rank": rank, "world": dist.get_world_size(),
                              "host": int(os.environ["DCPSTORE_TEST_HOST"]),
                              "local_rank": int(os.environ["LOCAL_RANK"])}
    try:
        record.update(status="ok", **ops[op](args))
        dist.barrier()
    except BaseException as exc:  # reported, judged by whoever started the job
        record.update(status="error", error=f"{type(exc).__name__}: {exc}",
                      traceback=traceback.format_exc())
    path = os.path.join(args["out"], f"{op}-rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if record["status"] == "ok" else 1)


def _free_network() -> ipaddress.IPv4Network:
    """A ``10.x.y.0/24`` that no interface of this machine uses."""
    used = _ip("-4", "-o", "addr", "show").stdout
    rng = random.Random()
    for _ in range(100):
        second, third = rng.randrange(100, 250), rng.randrange(0, 255)
        if f" 10.{second}.{third}." not in used:
            return ipaddress.IPv4Network(f"10.{second}.{third}.0/24")
    raise RuntimeError("no free 10.x.y.0/24 network for the hosts' bridge")


def sweep() -> list[str]:
    """Remove the namespaces and links that a killed run of this module left (those
    whose maker process is gone). Returns what was removed."""
    removed = []
    names = _ip("netns", "list", check=False).stdout.split()
    links = [line.split(":")[1].strip().split("@")[0]
             for line in _ip("-o", "link", "show", check=False).stdout.splitlines()
             if ":" in line]
    etcs = os.listdir("/etc/netns") if os.path.isdir("/etc/netns") else []
    for kind, name in ([("netns", n) for n in names] + [("link", n) for n in links]
                       + [("etc", n) for n in etcs]):
        if not name.startswith(_PREFIXES):
            continue
        pid = re.match(r"\d*", name[4:]).group()  # type: ignore[union-attr]
        if pid and not os.path.exists(f"/proc/{pid}"):
            if kind == "etc":
                shutil.rmtree(os.path.join("/etc/netns", name), ignore_errors=True)
            else:
                _ip(*(("netns", "del") if kind == "netns" else ("link", "del")), name,
                    check=False)
            removed.append(name)
    return removed
