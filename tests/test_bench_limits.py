"""The benchmark's limits (``benchmarks/limits.py``) move exactly the rank's bytes, and
the cold-load eviction (``benchmarks/pagecache.py``) really drops pages.

Every limit variant saves a small state and loads it back, warm and after an eviction;
the stored bytes are compared with the state's bytes and the load is checked bit-exact,
as the benchmark does. The S3 variants (boto3 client threads, boto3's managed transfer,
the CRT client) run against one SeaweedFS started by the benchmark's own ``Stores``, so
its data-directory eviction is exercised too. Nothing here is timed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `pytest` run as a script does not put the repo root there
    sys.path.insert(0, str(REPO))

from benchmarks import pagecache, systems  # noqa: E402
from benchmarks.limits import LimitLocal, LimitS3, LimitSystem  # noqa: E402
from benchmarks.servers import Stores  # noqa: E402
from benchmarks.systems import OpContext  # noqa: E402
from benchmarks.workload import RankState, WorkloadSpec  # noqa: E402
from dcpstore.testing.servers import free_port  # noqa: E402

MiB = 1 << 20


@pytest.fixture(scope="module")
def state() -> Iterator[RankState]:
    """A 12 MiB state at world size 1 (one gloo rank in this process)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        yield RankState(WorkloadSpec(12 * MiB + 4 * 1024 * 3, tensors=6),
                        init_device_mesh("cpu", (1,)))
    finally:
        dist.destroy_process_group()


def _droppable(path: Path) -> bool:
    """Whether the filesystem holding ``path`` keeps evictable page cache (tmpfs and
    ramfs pages are the files themselves)."""
    best, fstype = "", ""
    with open("/proc/mounts") as f:
        for line in f:
            _dev, mount, kind = line.split()[:3]
            if str(path).startswith(mount) and len(mount) >= len(best):
                best, fstype = mount, kind
    return fstype not in ("tmpfs", "ramfs")


def _roundtrip(limit: LimitSystem, ctx: OpContext, state: RankState,
               evict: Any) -> list[dict[str, Any]]:
    """Save, then load warm and (after ``evict()``) cold; every load verified."""
    op = limit.prepare_save(ctx, state)
    try:
        figures = [op.run()]
    finally:
        if op.close is not None:
            op.close()
    for cold in (False, True):
        if cold:
            evict()
        op = limit.prepare_load(ctx, state)
        try:
            figures.append(op.run())
            ok = op.verify() if op.verify is not None else state.verify()
        finally:
            if op.close is not None:
                op.close()
        assert ok, f"{limit.label}: {'cold' if cold else 'warm'} load is not bit-exact"
    return figures


def test_variants_parse_and_register() -> None:
    assert systems.get("limit-local").variant == "dd"
    wb = systems.get("limit-local[wb4MiBx3]")
    assert isinstance(wb, LimitLocal) and (wb.mode, wb.chunk, wb.threads) == (
        "wb", 4 * MiB, 3)
    crt = systems.get("limit-s3[crt-8MiBx4]")
    assert isinstance(crt, LimitS3) and (crt.client_kind, crt.part_size,
                                         crt.concurrency) == ("crt", 8 * MiB, 4)
    plain = systems.get("limit-s3[64MiBx8]")
    assert isinstance(plain, LimitS3) and plain.client_kind == "client"
    for bad in ("limit-local[fast]", "limit-local[direct1000x2]", "limit-s3[udp-8MiBx4]",
                "limit-s3[8MiB]"):
        with pytest.raises(ValueError):
            systems.get(bad)
    assert {"limit-local", "limit-s3", "limit-gcs"} <= set(systems.names())


@pytest.mark.parametrize("variant", ["dd", "wb1MiBx3", "direct1MiBx3"])
def test_local_limit_moves_the_bytes(variant: str, state: RankState, tmp_path: Path
                                     ) -> None:
    limit = systems.get(f"limit-local[{variant}]")
    assert isinstance(limit, LimitLocal)
    reason = limit.unavailable()
    if reason:
        pytest.skip(reason)
    with Stores(["local"], tmp_path, local_dir=str(tmp_path / "store"),
                count_requests=False) as stores:
        ctx = OpContext(stores.info["local"], "ckpt", 0, 1)
        try:
            figures = _roundtrip(limit, ctx, state, lambda: stores.evict("local", "ckpt"))
        except OSError as exc:
            if variant.startswith("direct") and exc.errno == 22:  # EINVAL
                pytest.skip(f"this filesystem refuses O_DIRECT: {exc}")
            raise
        stored = tmp_path / "store" / "ckpt" / "limit_0.bin"
        assert stored.read_bytes() == state.concat()  # exact size: no O_DIRECT padding
        assert figures[0]["mode"] == limit.mode


def test_evict_drops_the_pages(tmp_path: Path) -> None:
    if not _droppable(tmp_path):
        pytest.skip(f"{tmp_path} is on tmpfs/ramfs: its pages cannot be dropped")
    path = tmp_path / "sub" / "f.bin"
    path.parent.mkdir()
    size = 8 * MiB
    path.write_bytes(os.urandom(size))
    assert path.read_bytes()  # read: now in the cache
    before = pagecache.resident_bytes(str(path))
    assert before >= size // 2, f"only {before} of {size} bytes cached after a read"
    assert pagecache.evict([str(tmp_path)]) == size  # walks directories
    after = pagecache.resident_bytes(str(path))
    assert after <= size // 16, f"{after} of {size} bytes still cached after evict()"
    assert pagecache.evict([str(tmp_path / "missing")]) == 0


@pytest.mark.parametrize("variant", ["client-5MiBx2", "objects-5MiBx3", "transfer-5MiBx3",
                                     "crt-5MiBx4"])
def test_s3_limit_moves_the_bytes(variant: str, state: RankState, s3_stores: Stores
                                  ) -> None:
    limit = systems.get(f"limit-s3[{variant}]")
    assert isinstance(limit, LimitS3)
    reason = limit.unavailable()
    if reason:
        pytest.skip(reason)
    info = s3_stores.info["seaweedfs"]
    ctx = OpContext(info, f"ckpt-{limit.client_kind}", 0, 1)
    os.environ.update(systems.environment(ctx))  # as the ranks get it
    try:
        figures = _roundtrip(limit, ctx, state,
                             lambda: s3_stores.evict("seaweedfs", ctx.path))
        client = s3_stores._servers["seaweedfs"].client()
        try:
            if limit.client_kind == "objects":
                # one single-PUT object per part, in order; the loads read whole objects
                parts = -(-state.share_bytes // (5 * MiB))
                listed = client.list_objects_v2(Bucket=info.root, Prefix=ctx.path + "/")
                keys = sorted(o["Key"] for o in listed.get("Contents", []))
                assert keys == limit.object_keys(ctx, parts) and parts > 1
                assert figures[0]["objects"] == parts
                assert all(f["parts"] == parts for f in figures)
                body = b"".join(client.get_object(Bucket=info.root, Key=k)["Body"].read()
                                for k in keys)
            else:
                key = f"{ctx.path}/limit_0.bin"
                body = client.get_object(Bucket=info.root, Key=key)["Body"].read()
        finally:
            client.close()
        assert body == state.concat()
        assert figures[0]["part_size"] == 5 * MiB
    finally:
        s3_stores.delete("seaweedfs", ctx.path)


@pytest.fixture(scope="module")
def s3_stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stores]:
    """The benchmark's SeaweedFS store (no counting proxy)."""
    with Stores(["seaweedfs"], tmp_path_factory.mktemp("stores"),
                count_requests=False) as stores:
        yield stores


def test_seaweedfs_eviction_drops_its_volume_files(s3_stores: Stores) -> None:
    data_dir = s3_stores._servers["seaweedfs"].data_dir
    assert data_dir and os.path.isdir(data_dir)
    if not _droppable(Path(data_dir)):
        pytest.skip(f"{data_dir} is on tmpfs/ramfs")
    info = s3_stores.info["seaweedfs"]
    client = s3_stores._servers["seaweedfs"].client()
    payload = os.urandom(4 * MiB)
    try:
        client.put_object(Bucket=info.root, Key="evict/obj", Body=payload)
        assert client.get_object(Bucket=info.root, Key="evict/obj")["Body"].read() == payload

        def cached() -> int:
            total = 0
            for dirpath, _dirs, names in os.walk(data_dir):
                for name in names:
                    if name.endswith(".dat"):
                        total += pagecache.resident_bytes(os.path.join(dirpath, name))
            return total

        assert cached() >= len(payload)  # just written and read: cached
        s3_stores.evict("seaweedfs", "evict")
        assert cached() < len(payload) // 4
    finally:
        s3_stores.delete("seaweedfs", "evict")
        client.close()


def test_a_server_past_its_budget_is_replaced_by_a_fresh_one(tmp_path: Path) -> None:
    """``Stores.reserve`` replaces SeaweedFS (and its counting proxy, and the MSC
    profiles) once the bytes written pass the budget; everything reaches the new one."""
    with Stores(["seaweedfs"], tmp_path, count_requests=True, msc_part_sizes=(8 * MiB,),
                budgets={"seaweedfs": 10 * MiB}) as stores:
        first = stores.info["seaweedfs"]
        assert not stores.reserve("seaweedfs", 6 * MiB)  # 6 of 10 MiB
        client = stores._servers["seaweedfs"].client()
        client.put_object(Bucket=first.root, Key="old/obj", Body=b"x")
        client.close()
        assert not stores.reserve("seaweedfs", 4 * MiB)  # exactly the budget
        assert stores.reserve("seaweedfs", 1)  # past it: a fresh server first
        fresh = stores.info["seaweedfs"]
        assert stores.restarts == {"seaweedfs": 1} and stores.written["seaweedfs"] == 1
        assert fresh.endpoint_url != first.endpoint_url
        assert fresh.proxy_url and fresh.proxy_url != first.proxy_url
        assert fresh.msc_config != first.msc_config and fresh.msc_profile != first.msc_profile
        config = Path(str(fresh.msc_config)).read_text()
        assert fresh.msc_profile and fresh.msc_profile in config
        assert str(fresh.endpoint_url) in config and str(first.endpoint_url) not in config
        # the fresh server is empty and works, through the proxy too
        client = stores._servers["seaweedfs"].client()
        try:
            assert "Contents" not in client.list_objects_v2(Bucket=fresh.root)
        finally:
            client.close()
        import boto3

        via_proxy = boto3.client("s3", endpoint_url=fresh.proxy_url, region_name=fresh.region,
                                 aws_access_key_id=fresh.env["AWS_ACCESS_KEY_ID"],
                                 aws_secret_access_key=fresh.env["AWS_SECRET_ACCESS_KEY"])
        via_proxy.put_object(Bucket=fresh.root, Key="new/obj", Body=b"y")
        assert stores.proxies["seaweedfs"].stats.requests.get("PUT", 0) == 1
        stores.delete("seaweedfs", "new")
        assert stores.describe()["seaweedfs"]["fresh_restarts"] == 1


def test_limit_buffer_holds_the_shards_and_a_changed_byte_is_caught(state: RankState) -> None:
    """The limits' scratch buffer is filled and checked shard by shard (no concatenated
    copy is kept: at 4 GiB it was 2 GiB more per rank); one changed byte in any shard,
    the last one included, fails the check."""
    from benchmarks.limits import _destination, _matches, _source

    view = _source(state)
    expected = state.concat()
    assert bytes(view[:len(expected)]) == bytes(expected) and _matches(view, state)
    for at in (0, len(expected) // 2 + 1, len(expected) - 1):
        view[at] ^= 0xFF
        assert not _matches(view, state)
        view[at] ^= 0xFF
    assert _matches(view, state)
    assert not _matches(_destination(state), state)
