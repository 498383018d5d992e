"""Fault injection against real stores: a checkpoint loads exactly as saved or fails loudly.

A :class:`dcpstore.testing.FaultProxy` sits between dcpstore and SeaweedFS S3, moto S3,
fake-gcs-server and Azurite and answers a share of the requests with throttling (503), server
errors (500), connection resets, truncated responses (the request *was* processed, the
client cannot tell) and delays beyond the client's timeout, or stalls everything.
What this file proves:

- the proxy itself: requests are counted by kind, keep-alive / chunked / ``Expect:
  100-continue`` / large bodies pass through intact, every fault kind is what a plain
  HTTP client sees, decisions are reproducible by seed, ``stop()`` is prompt while
  connections are stalled;
- with ~10% of requests faulted (every kind), 2-rank DTensor saves and single-process
  saves (multipart-sized files) complete, and loads (also faulted) are bit-exact;
- a stalled store makes a 2-rank save fail on *every* rank, with a timeout error, within
  a bound derived from ``timeout x max_attempts`` (no rank hangs);
- faults aimed at the commit step (manifest and ``.metadata`` PUT, S3
  CompleteMultipartUpload, GCS compose, Azure Put Block List) while overwriting: afterwards the new
  checkpoint or the previous one loads bit-exact and verifies, never a mix;
- a ``.metadata`` PUT that lands but whose every answer is lost: the save reads it back
  and reports the commit (or, when even that cannot be told, raises but keeps the
  files): the new checkpoint loads, its files are never deleted from under it;
- truncated ranged and whole-object GETs are retried, never returned as short data.

Quick seeded subset by default; ``--full`` runs more seeds and bigger states.
"""

from __future__ import annotations

import contextlib
import copy
import http.client
import http.server
import json
import logging
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from mp import run_ranks
from stores import Store, make_store
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import dcpstore
from dcpstore.storage.backend import ReadRange
from dcpstore.testing import (
    FaultPlan,
    FaultProxy,
    RequestInfo,
    assert_state_equal,
    classify,
    many_dtypes_state,
)
from dcpstore.testing.servers import isolate_env
from dcpstore.tools.ops import verify_checkpoint

logger = logging.getLogger(__name__)

KiB = 1024
MiB = 1024 * KiB
#: Per-request timeout of the backends under test (a "delay" fault costs this much).
TIMEOUT = 1.5
ATTEMPTS = 8
RATE = 0.1
ALL_KINDS = ("503", "500", "reset", "truncate", "delay")



# -- stores behind the proxy --------------------------------------------------------------


def _via(store: Store, proxy: FaultProxy, **extra: Any) -> dict[str, Any]:
    """Backend options aimed at ``proxy``: small parts, short timeouts, fast retries
    (dcpstore's: on MSC, its own retry layer is set to one attempt, so the attempts the
    tests count are ``max_attempts``)."""
    opts: dict[str, Any] = {
        **store.via(proxy.endpoint_url, msc_retry_attempts=1).options, "timeout": TIMEOUT,
        "max_attempts": ATTEMPTS, "retry_backoff": 0.05, "retry_backoff_max": 0.5,
        "max_concurrency": 4,
    }
    if store.kind == "s3":
        opts.update(part_size=5 * MiB, addressing_style="path", connect_timeout=TIMEOUT)
    elif store.kind == "gcs":
        opts.update(part_size=256 * KiB, connect_timeout=TIMEOUT)
    elif store.kind == "azure":  # its one timeout is the connect and the read timeout
        opts.update(part_size=MiB)
    else:  # msc: its S3 profile sets the client's timeouts (below)
        opts.update(part_size=5 * MiB)
    opts.update(extra)
    if store.kind == "msc":  # the profile's own (5 s, 30 s) would outlast a "delay" fault
        config = copy.deepcopy(opts["config"])
        for profile in config["profiles"].values():
            profile["storage_provider"]["options"].update(
                connect_timeout=opts.get("connect_timeout", opts["timeout"]),
                read_timeout=opts["timeout"])
        opts["config"] = config
    if store.kind == "azure":
        opts.pop("connect_timeout", None)  # no such option: ``timeout`` covers connecting
    return opts


def _upstream(store: Store) -> str:
    assert store.upstream is not None, f"the {store.name} store has no HTTP endpoint"
    return store.upstream


#: The FaultProxy sits in front of an HTTP endpoint, which the local store lacks.
HTTP_STORES = pytest.mark.parametrize("store", ["seaweedfs", "moto", "gcs", "msc", "azure"],
                                      indirect=True)


def _seeds(count: int, rate: float, start: int = 0) -> list[int]:
    """The first ``count`` seeds from ``start`` whose first draw faults.

    The proxy decides whichever (matching) request reaches it first with the first draw
    of ``random.Random(seed)``, whatever the thread interleaving, so with these seeds
    the first request is always faulted and a run never passes without a fault.
    """
    out: list[int] = []
    seed = start
    while len(out) < count:
        if random.Random(seed).random() < rate:
            out.append(seed)
        seed += 1
    return out


def _report(test: str, store: str, proxy: FaultProxy, **extra: Any) -> None:
    """One line per run with the figures (``pytest -s`` / the log show them)."""
    stats = proxy.stats
    line = (f"FAULTS {test}[{store}] requests={stats.total_requests} "
            f"faults={stats.total_faults} {dict(sorted(stats.faults.items()))}"
            + "".join(f" {k}={v}" for k, v in extra.items()))
    logger.warning(line)
    print(line)


# -- states -------------------------------------------------------------------------------


def _state(seed: int, big_numel: int = 3 * MiB // 2) -> dict[str, Any]:
    """Every dtype DCP round-trips, objects, and one tensor large enough for a multipart
    upload (6 MiB: two S3 parts, 24 GCS parts)."""
    state = many_dtypes_state(seed)
    g = torch.Generator().manual_seed(seed)
    state["big"] = torch.randn(big_numel, generator=g)
    state["tag"] = seed
    return state


def _zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v.contiguous())
        elif isinstance(v, dict):
            out[k] = _zeros_like(v)
        else:
            out[k] = None
    return out


# -- the proxy on its own -----------------------------------------------------------------


class _Origin(http.server.BaseHTTPRequestHandler):
    """A tiny HTTP/1.1 upstream: ``GET /blob/<n>`` (``?chunked=1``), ``HEAD``,
    ``PUT``/``POST`` anything (answers the body's length), and a log of what it saw."""

    protocol_version = "HTTP/1.1"
    seen: list[tuple[str, str, int]] = []  # (method, path, client port)
    lock = threading.Lock()

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _record(self) -> None:
        with self.lock:
            self.seen.append((self.command, self.path, self.client_address[1]))

    @staticmethod
    def blob(n: int) -> bytes:
        return (bytes(range(256)) * (n // 256 + 1))[:n]

    def do_GET(self) -> None:
        self._record()
        n = int(self.path.split("?")[0].rsplit("/", 1)[-1]) if self.path.startswith("/blob/") \
            else 0
        data = self.blob(n)
        self.send_response(200)
        if "chunked=1" in self.path:
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(0, len(data), 10_000):
                piece = data[i:i + 10_000]
                self.wfile.write(b"%x\r\n" % len(piece) + piece + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
            return
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_HEAD = do_GET

    def do_PUT(self) -> None:
        self._record()
        total = 0
        digest = 0
        if "chunked" in self.headers.get("Transfer-Encoding", ""):
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    break
                data = self.rfile.read(size)
                self.rfile.readline()
                total += len(data)
                digest = (digest + sum(data[:64])) % 65536
        else:
            left = int(self.headers.get("Content-Length", "0"))
            while left:
                data = self.rfile.read(min(left, MiB))
                left -= len(data)
                total += len(data)
        body = json.dumps({"received": total}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_PUT


@pytest.fixture
def origin() -> Iterator[tuple[str, type[_Origin]]]:
    handler = type("Origin", (_Origin,), {"seen": [], "lock": threading.Lock()})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


def _conn(proxy: FaultProxy, timeout: float = 10.0) -> http.client.HTTPConnection:
    port = int(proxy.endpoint_url.rsplit(":", 1)[1])
    return http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)


@pytest.mark.parametrize(("method", "path", "query", "kind"), [
    ("GET", "/bucket/ckpt/.metadata", "", "GET"),
    ("GET", "/bucket", "list-type=2&prefix=ckpt%2F", "LIST"),
    ("GET", "/bucket/", "prefix=x", "LIST"),
    ("GET", "/bucket", "uploads&prefix=x", "LIST"),
    ("GET", "/bucket", "location", "GET"),
    ("get", "/bucket/ckpt/__0_0.distcp", "", "GET"),
    ("PUT", "/bucket/ckpt/.metadata", "", "PUT"),
    ("PUT", "/bucket/k", "partNumber=1&uploadId=x", "PUT"),
    ("POST", "/bucket/k", "uploadId=x", "POST"),
    ("POST", "/bucket", "delete", "POST"),
    ("HEAD", "/bucket/k", "", "HEAD"),
    ("DELETE", "/bucket/k", "uploadId=x", "DELETE"),
    ("GET", "/storage/v1/b/bucket/o", "prefix=ckpt%2F&maxResults=1000", "LIST"),
    ("GET", "/storage/v1/b/bucket/o/ckpt%2F.metadata", "alt=media", "GET"),
    ("GET", "/storage/v1/b/bucket", "fields=name", "GET"),
    ("POST", "/upload/storage/v1/b/bucket/o", "uploadType=multipart", "POST"),
    ("POST", "/storage/v1/b/bucket/o/ckpt%2Fx/compose", "", "POST"),
])
def test_classify(method: str, path: str, query: str, kind: str) -> None:
    assert classify(method, path, query) == kind


def test_proxy_passes_everything_through_and_counts(origin: tuple[str, type[_Origin]]
                                                    ) -> None:
    url, handler = origin
    big = 48 * MiB
    with FaultProxy(url) as proxy:
        conn = _conn(proxy)
        for n in (0, 1, 70_000):  # keep-alive: one client connection, several requests
            conn.request("GET", f"/blob/{n}")
            assert conn.getresponse().read() == _Origin.blob(n)
        conn.request("GET", "/blob/123457?chunked=1")
        assert conn.getresponse().read() == _Origin.blob(123457)
        conn.request("HEAD", "/blob/99")
        resp = conn.getresponse()
        assert resp.getheader("Content-Length") == "99" and resp.read() == b""
        conn.request("PUT", "/bucket/chunked", body=iter([b"ab", b"cde", b"f" * 100_000]),
                     encode_chunked=True)
        assert json.loads(conn.getresponse().read()) == {"received": 100_005}
        # a large body both ways, streamed
        conn.request("PUT", "/bucket/big", body=iter(memoryview(bytes(big))[i:i + MiB]
                                                     for i in range(0, big, MiB)),
                     headers={"Content-Length": str(big)})
        assert json.loads(conn.getresponse().read()) == {"received": big}
        conn.request("GET", f"/blob/{big}")
        data = conn.getresponse().read()
        assert len(data) == big and data[:512] == _Origin.blob(512)
        conn.request("GET", "/bucket?list-type=2")
        conn.getresponse().read()
        conn.close()
        # Expect: 100-continue, by hand: the proxy answers 100, then forwards the body
        with socket.create_connection(("127.0.0.1", int(proxy.endpoint_url.rsplit(":")[-1])),
                                      timeout=10) as raw:
            raw.sendall(b"PUT /bucket/k HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                        b"Expect: 100-continue\r\n\r\n")
            assert raw.recv(100).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
            raw.sendall(b"hello")
            answer = b""
            while b"}" not in answer:
                answer += raw.recv(1000)
            assert answer.startswith(b"HTTP/1.1 200") and b'{"received": 5}' in answer
        stats = proxy.stats
        assert stats.requests == Counter({"GET": 5, "HEAD": 1, "PUT": 3, "LIST": 1})
        assert stats.total_faults == 0 and stats.log == []
        assert stats.bytes_up == 100_005 + big + 5
        answers = sum(len(json.dumps({"received": n})) for n in (100_005, big, 5))
        assert stats.bytes_down == 70_001 + 123457 + big + answers
    ports = {port for _, path, port in handler.seen if path != "/bucket/k"}
    assert len(ports) == 1, "keep-alive: one upstream connection for one client connection"
    proxy.reset_stats()
    assert proxy.stats.total_requests == 0 and proxy.stats.bytes_up == 0


@pytest.mark.parametrize("path", ["/bucket/key", "/storage/v1/b/bucket/o/key"])
@pytest.mark.parametrize("status", ["503", "500"])
def test_error_faults_look_like_the_store(origin: tuple[str, type[_Origin]], path: str,
                                          status: str) -> None:
    url, handler = origin
    with FaultProxy(url, FaultPlan(rate=1.0, kinds=(status,))) as proxy:
        conn = _conn(proxy)
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read()
        assert resp.status == int(status)
        if path.startswith("/storage/"):
            error = json.loads(body)["error"]
            assert error["code"] == int(status) and error["errors"][0]["reason"]
            assert resp.getheader("X-GUploader-UploadID", "").startswith("faultproxy-")
        else:
            code = "SlowDown" if status == "503" else "InternalError"
            assert f"<Code>{code}</Code>".encode() in body
            assert resp.getheader("x-amz-request-id", "").startswith("faultproxy-")
        conn.request("PUT", path, body=b"x" * 1000)  # the connection stays usable
        assert conn.getresponse().status == int(status)
        conn.close()
    assert handler.seen == []  # the upstream never saw a faulted request
    assert proxy.stats.faults == Counter({status: 2})


def test_reset_fault_is_econnreset(origin: tuple[str, type[_Origin]]) -> None:
    url, handler = origin
    with FaultProxy(url, FaultPlan(rate=1.0, kinds=("reset",)), seed=1) as proxy:
        for i in range(6):  # mid-body or before the response, at random
            conn = _conn(proxy)
            with pytest.raises((ConnectionResetError, BrokenPipeError)):
                conn.request("PUT", f"/bucket/k{i}", body=b"y" * (4 * MiB))
                conn.getresponse().read()
            conn.close()
        conn = _conn(proxy)
        with pytest.raises(ConnectionResetError):
            conn.request("GET", "/blob/10")
            conn.getresponse()
        conn.close()
    assert handler.seen == []
    assert proxy.stats.faults == Counter({"reset": 7})
    assert 0 < proxy.stats.bytes_up < 6 * 4 * MiB  # some bodies were cut off mid-way


def test_truncate_fault_reaches_the_upstream_and_cuts_the_answer(
        origin: tuple[str, type[_Origin]]) -> None:
    url, handler = origin
    with FaultProxy(url, FaultPlan(rate=1.0, kinds=("truncate",)), seed=2) as proxy:
        for n, chunked in ((100_000, False), (5, False), (300_000, True)):
            conn = _conn(proxy)
            conn.request("GET", f"/blob/{n}" + ("?chunked=1" if chunked else ""))
            resp = conn.getresponse()
            assert resp.status == 200  # the real status and headers ...
            with pytest.raises(http.client.IncompleteRead):
                resp.read()  # ... but not the whole body
            conn.close()
        for _ in range(4):  # no body to cut: the status line is cut
            conn = _conn(proxy)
            conn.request("HEAD", "/blob/10")
            with pytest.raises((http.client.RemoteDisconnected, http.client.BadStatusLine)):
                conn.getresponse()
            conn.close()
    assert len(handler.seen) == 7  # every truncated request was processed upstream
    assert proxy.stats.faults == Counter({"truncate": 7})


@pytest.mark.parametrize("fault", ["delay", "stall"])
def test_delay_and_stall_outlast_the_client(origin: tuple[str, type[_Origin]], fault: str
                                            ) -> None:
    url, handler = origin
    plan = FaultPlan(rate=1.0, kinds=("delay",), delay_s=30.0) if fault == "delay" \
        else FaultPlan(stall=True)
    with FaultProxy(url, plan) as proxy:
        started = time.monotonic()
        conn = _conn(proxy, timeout=0.5)
        with pytest.raises(TimeoutError):
            conn.request("PUT", "/bucket/k", body=b"z" * 1000)
            conn.getresponse()
        conn.close()
        assert time.monotonic() - started < 5
        time.sleep(0.5)  # the proxy notices the client left and drops the request
        proxy.plan = FaultPlan()
        conn = _conn(proxy)
        conn.request("GET", "/blob/3")
        assert conn.getresponse().read() == _Origin.blob(3)
        conn.close()
    assert [m for m, _, _ in handler.seen] == ["GET"]
    assert proxy.stats.faults == Counter({fault: 1})


def test_delay_answers_when_the_client_waits(origin: tuple[str, type[_Origin]]) -> None:
    url, handler = origin
    with FaultProxy(url, FaultPlan(rate=1.0, kinds=("delay",), delay_s=0.3)) as proxy:
        conn = _conn(proxy)
        started = time.monotonic()
        conn.request("GET", "/blob/7")
        assert conn.getresponse().read() == _Origin.blob(7)
        assert time.monotonic() - started >= 0.3
        conn.close()
    assert len(handler.seen) == 1


def test_plan_match_max_faults_and_seed(origin: tuple[str, type[_Origin]]) -> None:
    url, _ = origin

    def pattern(seed: int) -> list[bool]:
        with FaultProxy(url, FaultPlan(rate=0.5, kinds=("503",)), seed=seed) as proxy:
            conn = _conn(proxy)
            out = []
            for _ in range(24):
                conn.request("GET", "/blob/1")
                resp = conn.getresponse()
                resp.read()
                out.append(resp.status == 503)
            conn.close()
            return out

    assert pattern(7) == pattern(7)  # reproducible
    assert pattern(7) != pattern(8)
    assert 0 < sum(pattern(7)) < 24

    seen: list[RequestInfo] = []

    def only_metadata(info: RequestInfo) -> bool:
        seen.append(info)
        return info.object_name.endswith(".metadata")

    with FaultProxy(url, FaultPlan(rate=1.0, kinds=("500",), match=only_metadata,
                                   max_faults=2)) as proxy:
        conn = _conn(proxy)
        statuses = []
        for key in ("a", ".metadata", "b", ".metadata", ".metadata"):
            conn.request("PUT", f"/bucket/ckpt/{key}", body=b"m")
            resp = conn.getresponse()
            resp.read()
            statuses.append(resp.status)
        assert statuses == [200, 500, 200, 500, 200]  # max_faults=2
        proxy.plan = FaultPlan(rate=1.0, kinds=("503",))  # replaced at runtime
        conn.request("GET", "/blob/1")
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 503
        conn.close()
    assert [(i.kind, i.object_name) for i in seen[:2]] == [("PUT", "ckpt/a"),
                                                           ("PUT", "ckpt/.metadata")]
    assert [r.path for r in proxy.stats.log] == ["/bucket/ckpt/.metadata"] * 2 + ["/blob/1"]


def test_stop_is_prompt_with_stalled_connections(origin: tuple[str, type[_Origin]]) -> None:
    url, _ = origin
    proxy = FaultProxy(url, FaultPlan(stall=True)).start()
    outcomes: list[str] = []

    def client(i: int) -> None:
        conn = _conn(proxy, timeout=60)
        try:
            body = b"q" * (i * MiB)  # some stall before, some inside a large body
            conn.request("PUT", f"/bucket/s{i}", body=body)
            conn.getresponse().read()
            outcomes.append("answered")
        except (OSError, http.client.HTTPException) as exc:
            outcomes.append(type(exc).__name__)
        finally:
            conn.close()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(5)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while proxy.stats.faults["stall"] < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proxy.stats.faults["stall"] == 5
    started = time.monotonic()
    proxy.stop()
    assert time.monotonic() - started < 3
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)
    assert len(outcomes) == 5 and "answered" not in outcomes


# -- saves and loads under random faults --------------------------------------------------


@HTTP_STORES
def test_single_process_save_load_under_faults(store: Store, full_run: bool) -> None:
    """~10% of requests faulted (every kind): every save and load completes, bit-exact."""
    seeds = _seeds(6 if full_run else 1, RATE)
    total = Counter[str]()
    for seed in seeds:
        with FaultProxy(_upstream(store), FaultPlan(rate=RATE, kinds=ALL_KINDS), seed=seed
                        ) as proxy:
            opts = _via(store, proxy)
            uri = store.uri(f"sp{seed}")
            state = _state(seed, (6 if full_run else 3) * MiB // 2)
            dcpstore.save(state, uri, **opts)
            loaded = _zeros_like(state)
            dcpstore.load(loaded, uri, **opts)
            assert_state_equal(loaded, state)
            assert verify_checkpoint(uri, **opts).ok
            assert proxy.stats.total_faults > 0
            # garbage a lost answer can leave (e.g. a CreateMultipartUpload retried after
            # it succeeded): harmless, found and removed by `dcpstore gc`
            backend = dcpstore.open_backend(uri, **opts)
            _report("single_process", store.name, proxy, seed=seed,
                    leftover_uploads=len(backend.list_uploads()))
            backend.close()
            total.update(proxy.stats.faults)
    assert total.total() >= len(seeds)


def _dist_state(seed: int, mesh: Any, *, zeros: bool = False, big_rows: int = 1536
                ) -> dict[str, Any]:
    """DTensors sharded over the ranks (one 12 MiB: 6 MiB per rank, multipart), a
    replicated tensor and plain objects; the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    full = {
        "w_big": torch.randn(big_rows, 2048, generator=g),
        "w_odd": torch.randn(37, 5, generator=g),
        "bias": torch.randn(11, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 1000, (9, 3), generator=g),
    }
    if zeros:
        full = {k: torch.zeros_like(v) for k, v in full.items()}
    return {
        "model": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()},
        "replicated": torch.zeros(10) if zeros else torch.arange(10.0) * seed,
        "extra": {"step": None if zeros else seed, "name": None if zeros else f"run{seed}"},
    }


def _local(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    return value


def _rank_save_load(rank: int, world_size: int, jobs: list[tuple[str, dict[str, Any], int]],
                    big_rows: int) -> list[str | None]:
    """For each ``(uri, options, seed)``: save a DTensor state from every rank, load it
    back into zeros, compare this rank's shards. Returns a mismatch (or ``None``) per job.
    """
    mesh = init_device_mesh("cpu", (world_size,))
    out: list[str | None] = []
    for uri, options, seed in jobs:
        state = _dist_state(seed, mesh, big_rows=big_rows)
        dcpstore.save(state, uri, **options)
        loaded = _dist_state(seed, mesh, zeros=True, big_rows=big_rows)
        dcpstore.load(loaded, uri, **options)
        try:
            assert_state_equal(_local(loaded), _local(state))
            out.append(None)
        except AssertionError as exc:
            out.append(str(exc))
    return out


@pytest.fixture
def all_stores(seaweedfs_s3: Any, moto_s3: Any, gcs_server: Any, azurite_blob: Any,
               tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Store]:
    """Four stand-ins at once (for one set of spawned ranks: each store costs a
    multi-rank save, so the S3, GCS and Azure clients are covered and MSC, an S3 client
    too, runs in the single-process tests). The environment holds SeaweedFS's
    credentials (moto accepts any) and Azurite's connection string."""
    servers = {"seaweedfs": seaweedfs_s3, "moto": moto_s3, "gcs": gcs_server,
               "azure": azurite_blob}
    stores = [make_store(name, "faults", tmp_path, servers, None) for name in servers]
    isolate_env(monkeypatch, extra={**stores[2].env, **stores[3].env, **stores[0].env})
    return stores


@pytest.mark.multiprocess
def test_two_rank_save_load_under_faults(all_stores: list[Store], full_run: bool) -> None:
    """2 ranks save and load a DTensor state (6 MiB shard per rank: multipart) through
    ~10% faulted requests of every kind, on every store: bit-exact, and it verifies."""
    per_store = 3 if full_run else 1
    seeds = _seeds(per_store * len(all_stores), RATE, start=100)
    with contextlib.ExitStack() as stack:
        runs = []
        for i, seed in enumerate(seeds):
            store = all_stores[i % len(all_stores)]
            proxy = stack.enter_context(
                FaultProxy(_upstream(store), FaultPlan(rate=RATE, kinds=ALL_KINDS), seed=seed))
            runs.append((store, proxy, store.uri(f"mr{seed}"), seed))
        jobs = [(uri, _via(store, proxy), seed) for store, proxy, uri, seed in runs]
        results = run_ranks(_rank_save_load, 2, jobs, 3072 if full_run else 1536,
                            timeout=120 * len(jobs))
        assert results == [[None] * len(jobs)] * 2
        for store, proxy, uri, seed in runs:
            assert verify_checkpoint(uri, **_via(store, proxy)).ok
            assert proxy.stats.total_faults > 0
            _report("two_rank", store.name, proxy, seed=seed)


# -- a stalled store ----------------------------------------------------------------------

#: Per-request timeout and attempts in the stall tests: a stalled request costs both.
STALL_TIMEOUT = 1.0
STALL_ATTEMPTS = 3


def _rank_save_expect_failure(rank: int, world_size: int,
                              jobs: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Save to each ``(uri, options)`` in turn; return what each save raised (type names,
    message) and how long this rank took to get it."""
    mesh = init_device_mesh("cpu", (world_size,))
    state = _dist_state(1, mesh, big_rows=64)
    out = []
    for uri, options in jobs:
        dist.barrier()  # time each save on its own (not the coordinator's previous cleanup)
        started = time.monotonic()
        try:
            dcpstore.save(state, uri, **options)
            out.append({"types": [], "message": "saved", "elapsed": time.monotonic() - started})
        except Exception as exc:
            out.append({"types": [c.__name__ for c in type(exc).__mro__], "message": str(exc),
                        "elapsed": time.monotonic() - started})
    return out


def _is_data_upload(info: RequestInfo) -> bool:
    return info.method in ("PUT", "POST") and ".distcp" in info.object_name


@pytest.mark.multiprocess
def test_stalled_store_fails_every_rank_in_bounded_time(all_stores: list[Store],
                                                        full_run: bool) -> None:
    """A store that accepts connections and never answers (everything, or only the data
    uploads): every rank raises a timeout error in bounded time; nothing hangs, nothing
    is committed."""
    cases = [("seaweedfs", "everything"), ("gcs", "data"), ("azure", "everything")]
    if full_run:
        cases += [("moto", "everything"), ("seaweedfs", "data"), ("gcs", "everything"),
                  ("moto", "data"), ("azure", "data")]
    stores = {s.name: s for s in all_stores}
    # The failing request costs timeout x attempts (+ backoff); after a failure the
    # coordinator's cleanup may wait as long again when the store stalls that too.
    bound = 2 * STALL_TIMEOUT * STALL_ATTEMPTS + 10
    with contextlib.ExitStack() as stack:
        runs = []
        for name, what in cases:
            plan = FaultPlan(stall=True, match=None if what == "everything" else _is_data_upload)
            proxy = stack.enter_context(FaultProxy(_upstream(stores[name]), plan))
            runs.append((stores[name], what, proxy, stores[name].uri(f"stall-{what}")))
        jobs = [(uri, _via(store, proxy, timeout=STALL_TIMEOUT, connect_timeout=STALL_TIMEOUT,
                          max_attempts=STALL_ATTEMPTS))
                for store, _, proxy, uri in runs]
        results = run_ranks(_rank_save_expect_failure, 2, jobs,
                            timeout=len(jobs) * bound + 60)
        for i, (store, what, proxy, uri) in enumerate(runs):
            for rank, per_rank in enumerate(results):
                result = per_rank[i]
                assert "TimeoutError" in result["types"], (store.name, what, rank, result)
                assert "timed out" in result["message"], (store.name, what, rank, result)
                assert result["elapsed"] < bound, (store.name, what, rank, result)
            assert proxy.stats.faults["stall"] >= STALL_ATTEMPTS
            _report(f"stall_{what}", store.name, proxy, bound=f"{bound:.0f}s", elapsed="/".join(
                f"{per_rank[i]['elapsed']:.1f}s" for per_rank in results))
            proxy.plan = FaultPlan()
            with pytest.raises(FileNotFoundError):  # nothing was committed
                dcpstore.load({"replicated": torch.zeros(10)}, uri, **_via(store, proxy))


# -- faults at the commit step ------------------------------------------------------------


#: A "delay" is a client timeout: on the wire the same as a reset before the answer
#: (the store never saw the request), only slower; the commit test leaves it out.
COMMIT_KINDS = ("503", "500", "reset", "truncate")


def _is_commit_request(info: RequestInfo) -> bool:
    """The requests that commit a file or a checkpoint."""
    name = info.object_name.rsplit("/", 1)[-1]
    if info.method in ("PUT", "POST") and (
            name == ".metadata" or (name.startswith(".dcpstore-") and name.endswith(".json"))):
        return True  # manifest and .metadata (S3 PUT, GCS upload POST)
    if info.method == "POST" and "uploadId=" in info.query:
        return True  # S3 CompleteMultipartUpload
    if info.method == "PUT" and "comp=blocklist" in info.query:
        return True  # Azure Put Block List
    return info.method == "POST" and info.path.endswith("/compose")  # GCS compose


@HTTP_STORES
def test_commit_faults_while_overwriting_never_mix(store: Store, full_run: bool) -> None:
    """Faults on the commit requests of an overwrite: the new checkpoint or the previous
    one loads bit-exact (and verifies) afterwards, never a mix or a partial one."""
    seeds = range(16 if full_run else 4)
    uri = store.uri("commit")
    outcomes: Counter[str] = Counter()
    commit_faults: Counter[str] = Counter()
    with FaultProxy(_upstream(store)) as clean:
        current = _state(1000)
        dcpstore.save(current, uri, **_via(store, clean))
    for seed in seeds:
        new = _state(seed)
        plan = FaultPlan(rate=0.6, kinds=COMMIT_KINDS, match=_is_commit_request)
        with FaultProxy(_upstream(store), plan, seed=seed) as proxy:
            opts = _via(store, proxy, max_attempts=3)
            try:
                dcpstore.save(new, uri, overwrite=True, **opts)
                error: BaseException | None = None
            except Exception as exc:
                error = exc
            commit_faults.update(proxy.stats.faults)
            proxy.plan = FaultPlan()
            loaded = _zeros_like(new)
            dcpstore.load(loaded, uri, **opts)
            assert verify_checkpoint(uri, **opts).ok
        if error is None:
            outcomes["committed"] += 1
            assert loaded["tag"] == seed
        else:
            assert isinstance(error, OSError), repr(error)  # loud and specific
            outcomes["kept previous" if loaded["tag"] == current["tag"] else
                     "committed despite error"] += 1
            assert loaded["tag"] in (seed, current["tag"])
        expected = new if loaded["tag"] == seed else current
        assert_state_equal(loaded, expected)  # all of one checkpoint, nothing of the other
        current = expected
    line = (f"FAULTS commit_overwrite[{store.name}] saves={len(seeds)} "
            f"faults={commit_faults.total()} {dict(sorted(commit_faults.items()))} "
            f"outcomes={dict(outcomes)}")
    logger.warning(line)
    print(line)
    assert commit_faults.total() > 0
    assert outcomes["committed"] > 0 and outcomes["kept previous"] > 0


# -- truncated reads ----------------------------------------------------------------------


def _is_get(info: RequestInfo) -> bool:
    return info.kind == "GET"


@HTTP_STORES
def test_truncated_reads_are_retried_never_short(store: Store) -> None:
    """Truncated ranged and whole-object GETs: retried, exact; when every attempt is cut,
    an error, never short data."""
    data = random.Random(5).randbytes(3 * MiB + 17)
    ranges = [ReadRange("blob", off, n) for off, n in
              [(0, 1), (0, MiB), (5, 300_000), (MiB - 3, MiB + 20), (3 * MiB, 17),
               (2 * MiB, MiB + 17), (12_345, 777_777)]]
    with FaultProxy(_upstream(store)) as proxy:
        uri = store.uri("reads")
        backend = dcpstore.open_backend(uri, **_via(store, proxy))
        backend.put("blob", data)
        seed_plan = FaultPlan(rate=0.5, kinds=("truncate",), match=_is_get)
        proxy.plan = seed_plan
        for _ in range(3):
            got = dict(backend.read_ranges(ranges))
            for i, r in enumerate(ranges):
                assert bytes(got[i]) == data[r.offset:r.offset + r.length], r
            assert backend.get("blob") == data
        assert proxy.stats.faults["truncate"] > 0
        truncated = proxy.stats.faults["truncate"]
        # every attempt truncated: the read fails after max_attempts, loudly
        proxy.plan = FaultPlan(rate=1.0, kinds=("truncate",), match=_is_get)
        proxy.reset_stats()
        with pytest.raises(OSError):
            list(backend.read_ranges([ReadRange("blob", 100, MiB)]))
        assert proxy.stats.faults["truncate"] == ATTEMPTS
        with pytest.raises(OSError):
            backend.get("blob")
        exhausted = proxy.stats.faults["truncate"]
        backend.close()

        # a whole checkpoint load with a third of its GETs truncated
        proxy.plan = FaultPlan()
        state = _state(7)
        ckpt = store.uri("reads-ckpt")
        dcpstore.save(state, ckpt, **_via(store, proxy))
        proxy.reset_stats()
        proxy.plan = FaultPlan(rate=0.34, kinds=("truncate",), match=_is_get)
        for _ in range(3):
            loaded = _zeros_like(state)
            dcpstore.load(loaded, ckpt, **_via(store, proxy))
            assert_state_equal(loaded, state)
        _report("truncated_reads", store.name, proxy, backend_level_truncations=truncated,
                every_attempt_truncated=exhausted)
        assert proxy.stats.faults["truncate"] > 0


def _is_metadata_put(info: RequestInfo) -> bool:
    return info.method in ("PUT", "POST") and info.object_name.endswith("/.metadata")


@HTTP_STORES
@pytest.mark.parametrize("readback", ["works", "fails"])
def test_commit_that_landed_but_every_answer_was_lost(store: Store, readback: str) -> None:
    """Every ``.metadata`` PUT reaches the store but its answer is cut. The writer reads
    ``.metadata`` back: if it holds this save, the save is committed; if that cannot be
    told (``readback="fails"``), the save raises but keeps its files. Either way the files
    the committed ``.metadata`` names are never deleted (that would lose the new and the
    previous checkpoint both), and the new checkpoint loads."""
    uri = store.uri("landed")
    old = _state(1)
    with FaultProxy(_upstream(store)) as clean:
        dcpstore.save(old, uri, **_via(store, clean))
    new = _state(2)
    put_seen = threading.Event()

    def match(info: RequestInfo) -> bool:
        if _is_metadata_put(info):
            put_seen.set()
            return True
        return (readback == "fails" and put_seen.is_set() and info.kind == "GET"
                and info.object_name.endswith("/.metadata"))

    plan = FaultPlan(rate=1.0, kinds=("truncate",), match=match)
    with FaultProxy(_upstream(store), plan) as proxy:
        opts = _via(store, proxy, max_attempts=3)
        try:
            dcpstore.save(new, uri, overwrite=True, **opts)
            error: BaseException | None = None
        except OSError as exc:
            error = exc
        _report("commit_landed", store.name, proxy, readback=readback,
                raised=type(error).__name__)
        # every attempt's answer was cut; with conditional writes the second attempt's
        # condition fails (the first one landed), and that answer ends the retries
        conditional = store.backend().conditional_writes
        assert proxy.stats.faults["truncate"] >= (2 if conditional else 3)
        assert (error is None) == (readback == "works")
        proxy.plan = FaultPlan()
        loaded = _zeros_like(new)
        dcpstore.load(loaded, uri, **opts)
        assert verify_checkpoint(uri, **opts).ok
    # the store holds the new .metadata: the new checkpoint is the one that loads
    assert_state_equal(loaded, new)
