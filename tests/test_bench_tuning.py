"""The tuning grid's one-at-a-time options (issue 33) reach the peers for real.

The grid (:mod:`benchmarks.tuning`, :class:`benchmarks.adapters.Grid`) tries, beyond the
crossed threads and part sizes, the fsspec filesystems' block size (s3fs and gcsfs),
s3torchconnector's reader type (``S3ReaderConstructor``) and its CRT client's throughput
target, each one value at a time (s3fs's cache type only where ``--grid`` names it).
Here every grid point's label parses back to its options, ``--grid`` pins a peer as
before (quick mode: one point), the tuning picks a reader-only option for the load only,
and each option is found on the object the peer's adapter builds: the fsspec
filesystem's ``default_block_size`` / ``default_cache_type`` (and a file it opens), the
``S3StorageReader``'s reader constructor and the ``S3ClientConfig`` of its client. Those
builds reach a loopback endpoint that nothing listens on, and a guard fails the test on
any connection. The last test saves and loads through SeaweedFS with the new options
(skipped without it).
"""

from __future__ import annotations

import inspect
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `pytest` run as a script does not put the repo root there
    sys.path.insert(0, str(REPO))

from benchmarks import systems, tuning  # noqa: E402
from benchmarks.adapters import Grid, options_variant  # noqa: E402
from benchmarks.options import options_for, parse_opts  # noqa: E402
from benchmarks.servers import StoreInfo  # noqa: E402
from benchmarks.systems import OpContext  # noqa: E402

__all__: list[str] = []

MiB = 1 << 20
#: Where the adapters are pointed: loopback, a port nothing serves (discard).
NOWHERE = "http://127.0.0.1:9"
#: ``--grid`` of quick mode (benchmarks.cli): one point per peer.
QUICK_GRID = {"thread_count": (4,), "part_size": (32 * MiB,)}


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail on any connection a Python client opens (building is all these tests do),
    with dummy S3 credentials and the loopback endpoint in the environment."""
    def refuse(sock: socket.socket, address: Any) -> None:
        raise AssertionError(f"the test connected to {address!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_ENDPOINT_URL", NOWHERE)  # s3torchconnector's CRT reads it


def _ctx(kind: str, label: str, op: str) -> OpContext:
    """The context a rank gets for ``label``'s ``op`` on a store at :data:`NOWHERE`."""
    info = StoreInfo(name="seaweedfs" if kind == "s3" else "gcs", root="bucket",
                     options={"endpoint_url": NOWHERE})
    return OpContext(info, "ckpt", 0, 1, options=options_for({}, label, op))


def _require(label: str) -> Any:
    system = systems.get(label)
    reason = system.unavailable()
    if reason:
        pytest.skip(reason)
    return system


# -- the grid ---------------------------------------------------------------------------


def test_grid_points_per_peer() -> None:
    """Crossed points first (unchanged), then one point per non-default value of each
    one-at-a-time option, at the crossed grid's defaults."""
    counts = {name: len(tuning.grid_points(systems.get(name).grid, {}))
              for name in ("torch-fs", "torch-fsspec-s3", "torch-fsspec-gcs",
                           "s3torchconnector", "msc")}
    assert counts == {"torch-fs": 3, "torch-fsspec-s3": 5, "torch-fsspec-gcs": 5,
                      "s3torchconnector": 10, "msc": 6}
    s3fs_points = tuning.grid_points(systems.get("torch-fsspec-s3").grid, {})
    assert s3fs_points == [
        {"thread_count": 1}, {"thread_count": 4}, {"thread_count": 8},
        {"thread_count": 1, "block_size": 16 * MiB},
        {"thread_count": 1, "block_size": 128 * MiB}]
    gcs_points = tuning.grid_points(systems.get("torch-fsspec-gcs").grid, {})
    assert gcs_points[3:] == [{"thread_count": 1, "block_size": 16 * MiB},
                              {"thread_count": 1, "block_size": 64 * MiB}]
    s3tc = tuning.grid_points(systems.get("s3torchconnector").grid, {})
    assert s3tc[:6] == tuning.grid_points(dict(systems.get("s3torchconnector").grid), {})
    base = {"part_size": 8 * MiB, "thread_count": 1}
    assert s3tc[6:] == [{**base, "reader_constructor": "sequential"},
                        {**base, "reader_constructor": "range_based"},
                        {**base, "throughput_target_gbps": 25},
                        {**base, "throughput_target_gbps": 100}]
    # the crossed grid still reads as a plain dict (what benchmarks.cli and the docs see)
    assert systems.get("s3torchconnector").grid == {"thread_count": (1, 4, 8),
                                                    "part_size": (8 * MiB, 32 * MiB)}


def test_grid_defaults_are_the_libraries() -> None:
    """Every one-at-a-time option lists the library's own default first, and
    ``defaults`` says so (a tuned best equal to it is not run twice)."""
    for name in ("torch-fsspec-s3", "torch-fsspec-gcs", "s3torchconnector"):
        system = systems.get(name)
        assert isinstance(system.grid, Grid)
        for key, values in system.grid.single.items():
            assert system.defaults[key] == values[0], (name, key)
            assert key in system.reader_keys, (name, key)  # they all change the load
    if systems.get("torch-fsspec-s3").unavailable() is None:
        import s3fs

        assert s3fs.S3FileSystem.default_block_size == systems.GRID_S3FS_BLOCK_SIZES[0]
        s3fs_grid = systems.get("torch-fsspec-s3").grid
        assert isinstance(s3fs_grid, Grid) and s3fs_grid.single["cache_type"] == ("readahead",)
        params = inspect.signature(s3fs.S3FileSystem.__init__).parameters
        assert params["default_cache_type"].default == systems.GRID_S3FS_CACHE_TYPES[0]
    if systems.get("torch-fsspec-gcs").unavailable() is None:
        import gcsfs

        assert gcsfs.GCSFileSystem.default_block_size == systems.GRID_GCSFS_BLOCK_SIZES[0]


def test_grid_override_pins_the_points() -> None:
    """``--grid`` that changes a peer's options leaves its one-at-a-time options at the
    defaults unless it names them; then they are crossed with the rest."""
    for name in ("torch-fsspec-s3", "torch-fsspec-gcs", "s3torchconnector", "msc"):
        assert len(tuning.grid_points(systems.get(name).grid, QUICK_GRID)) == 1, name
    s3tc = systems.get("s3torchconnector").grid
    points = tuning.grid_points(s3tc, {"thread_count": (4,),
                                       "reader_constructor": ("sequential", "range_based")})
    assert points == [
        {"part_size": p, "reader_constructor": r, "thread_count": 4}
        for p in (8 * MiB, 32 * MiB) for r in ("sequential", "range_based")]
    # an override of options the peer does not have leaves its grid whole
    assert len(tuning.grid_points(systems.get("torch-fsspec-s3").grid,
                                  {"part_size": (8 * MiB,)})) == 5
    # s3fs's cache type is in the grid at its default only (no point of its own): --grid
    # names it to try it
    s3fs = systems.get("torch-fsspec-s3").grid
    assert tuning.grid_points(s3fs, {"thread_count": (1,), "cache_type": ("readahead", None)}
                              ) == [{"cache_type": "readahead", "thread_count": 1},
                                    {"cache_type": None, "thread_count": 1}]
    # parse_grid reads the new options' values
    grid = tuning.parse_grid(["block_size=16MiB,64MiB", "reader_constructor=range_based",
                              "throughput_target_gbps=25,100", "cache_type=none"])
    assert grid == {"block_size": (16 * MiB, 64 * MiB), "reader_constructor": ("range_based",),
                    "throughput_target_gbps": (25, 100), "cache_type": (None,)}


def test_point_labels_parse_back() -> None:
    for name in ("torch-fsspec-s3", "torch-fsspec-gcs", "s3torchconnector"):
        for point in tuning.grid_points(systems.get(name).grid, {}):
            label = tuning.point_label(name, point)
            assert systems.get(label).variant_options() == point, label
            assert options_for({}, label, "load") == point
    assert options_variant({"block_size": 16 * MiB, "cache_type": None}) == (
        "block_size=16MiB,cache_type=None")
    assert tuning.point_label("s3torchconnector", {
        "part_size": 8 * MiB, "thread_count": 1, "reader_constructor": "range_based"}) == (
        "s3torchconnector[part_size=8MiB,reader_constructor=range_based,thread_count=1]")
    # and --opt reaches them too
    scoped = parse_opts(["torch-fsspec-gcs.block_size=64MiB",
                         "s3torchconnector.reader_constructor=sequential"])
    assert options_for(scoped, "torch-fsspec-gcs") == {"block_size": 64 * MiB}
    assert options_for(scoped, "s3torchconnector", "load") == {
        "reader_constructor": "sequential"}


def _case(system: str, op: str, seconds: float) -> dict[str, Any]:
    return {"store": "seaweedfs", "system": system, "op": op, "world_size": 1,
            "saved_at": 1, "runs": [[{"seconds": seconds}]]}


def test_a_reader_only_option_is_picked_for_the_load() -> None:
    base = "s3torchconnector[part_size=8MiB,thread_count=1]"
    ranged = "s3torchconnector[part_size=8MiB,reader_constructor=range_based,thread_count=1]"
    fast = "s3torchconnector[part_size=8MiB,thread_count=1,throughput_target_gbps=100]"
    cases = [_case(base, "save", 2.0), _case(base, "load", 1.0),
             _case(ranged, "save", 2.1), _case(ranged, "load", 0.5),
             _case(fast, "save", 1.5), _case(fast, "load", 0.8)]
    best = tuning.pick_best("s3torchconnector", cases, state_bytes=100_000_000)
    assert best["save"]["options"] == {"part_size": 8 * MiB, "thread_count": 1,
                                       "throughput_target_gbps": 100}
    assert best["load"]["options"] == {"part_size": 8 * MiB,
                                       "reader_constructor": "range_based"}
    assert not tuning.is_default("s3torchconnector", best)
    tuned = {"s3torchconnector": best}
    assert options_for({}, "s3torchconnector[best]", "load", tuned) == {
        "part_size": 8 * MiB, "reader_constructor": "range_based"}
    # the three points are three readers: the leaders are the fastest of each
    assert tuning.leaders("s3torchconnector", cases, 1) == [fast, ranged]
    # a best equal to the library's defaults is the defaults
    plain = [_case(base, "save", 1.0), _case(base, "load", 0.1)]
    assert tuning.is_default("s3torchconnector",
                             tuning.pick_best("s3torchconnector", plain, 100_000_000))


# -- each option reaches the peer -------------------------------------------------------


@pytest.mark.parametrize(("block", "cache"), [(16 * MiB, None), (128 * MiB, "readahead")])
def test_s3fs_block_size_and_cache_type_reach_the_filesystem(
        no_network: None, block: int, cache: str | None) -> None:
    system = _require("torch-fsspec-s3")
    label = tuning.point_label("torch-fsspec-s3", {"thread_count": 4, "block_size": block,
                                                   "cache_type": cache})
    writer = system.writer(_ctx("s3", label, "save"))
    reader = system.reader(_ctx("s3", label, "load"))
    for obj in (writer, reader):
        fs = obj.fs.fs
        assert type(fs).__name__ == "S3FileSystem"
        assert fs.default_block_size == block
        assert fs.default_cache_type == (cache or "none")
        assert fs.endpoint_url == NOWHERE
    assert writer.thread_count == 4  # the writer's own option still reaches it
    # torch opens every file with the filesystem's defaults: a read (size given, so no
    # HEAD request) gets that block size and cache
    f = reader.fs.fs.open("bucket/ckpt/__0_0.distcp", "rb", size=1000)
    try:
        assert f.blocksize == block
        assert type(f.cache).__name__ == ("BaseCache" if cache is None else "ReadAheadCache")
    finally:
        f.close()


def test_s3fs_defaults_pass_nothing(no_network: None) -> None:
    """The default point leaves the filesystem at s3fs's own block size and cache."""
    system = _require("torch-fsspec-s3")
    reader = system.reader(_ctx("s3", "torch-fsspec-s3[thread_count=1]", "load"))
    assert reader.fs.fs.default_block_size == systems.GRID_S3FS_BLOCK_SIZES[0]
    assert reader.fs.fs.default_cache_type == "readahead"


@pytest.mark.parametrize("block", [16 * MiB, 64 * MiB])
def test_gcsfs_block_size_reaches_the_filesystem(no_network: None, block: int) -> None:
    system = _require("torch-fsspec-gcs")
    label = tuning.point_label("torch-fsspec-gcs", {"thread_count": 8, "block_size": block})
    writer = system.writer(_ctx("gcs", label, "save"))
    reader = system.reader(_ctx("gcs", label, "load"))
    for obj in (writer, reader):
        # (opening a file would ask the server for the bucket's type: not done here)
        assert "GCSFileSystem" in [c.__name__ for c in type(obj.fs.fs).__mro__]
        assert obj.fs.fs.default_block_size == block
    assert writer.thread_count == 8


@pytest.mark.parametrize("kind", ["sequential", "range_based", "dcp_optimized"])
def test_s3torchconnector_reader_type_reaches_the_reader(no_network: None, kind: str) -> None:
    system = _require("s3torchconnector")
    from s3torchconnector import S3ReaderConstructor

    base = {"part_size": 8 * MiB, "thread_count": 1}
    label = tuning.point_label("s3torchconnector", {**base, "reader_constructor": kind})
    reader = system.reader(_ctx("s3", label, "load"))
    assert S3ReaderConstructor.get_reader_type_string(reader._reader_constructor) == kind
    # the writer ignores a reader's option ([best]'s save may carry one)
    writer = system.writer(_ctx("s3", label, "save"))
    assert writer.thread_count == 1


def test_s3torchconnector_default_reader_is_dcp_optimized(no_network: None) -> None:
    """No option: the library's default reader, which the grid lists first."""
    system = _require("s3torchconnector")
    from s3torchconnector import S3ReaderConstructor

    reader = system.reader(_ctx("s3", "s3torchconnector[part_size=8MiB,thread_count=1]",
                                "load"))
    assert (S3ReaderConstructor.get_reader_type_string(reader._reader_constructor)
            == systems.GRID_S3TC_READERS[0])
    with pytest.raises(ValueError, match="reader_constructor"):
        system.reader_constructor("default")


@pytest.mark.parametrize("gbps", [25, 100])
def test_s3torchconnector_throughput_target_reaches_the_client(no_network: None,
                                                               gbps: int) -> None:
    system = _require("s3torchconnector")
    from s3torchconnector import S3ClientConfig

    assert S3ClientConfig().throughput_target_gbps == systems.GRID_S3TC_THROUGHPUT[0]
    label = tuning.point_label("s3torchconnector", {"part_size": 8 * MiB, "thread_count": 1,
                                                    "throughput_target_gbps": gbps})
    for op, build in (("save", system.writer), ("load", system.reader)):
        obj = build(_ctx("s3", label, op))
        config = obj.fs._client._s3client_config  # what its CRT client is built from
        assert config.throughput_target_gbps == float(gbps)
        assert config.part_size == 8 * MiB and config.force_path_style


# -- end to end: SeaweedFS ----------------------------------------------------------------


@pytest.fixture(scope="module")
def seaweedfs_info(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The benchmark's SeaweedFS store and a one-rank gloo group with a small state."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.servers import Stores
    from benchmarks.workload import RankState, WorkloadSpec
    from dcpstore.testing.servers import free_port

    try:
        stores = Stores(["seaweedfs"], tmp_path_factory.mktemp("stores"),
                        count_requests=False)
        stores.__enter__()
    except Exception as exc:  # no weed binary here
        pytest.skip(f"SeaweedFS did not start: {exc}")
    dist.init_process_group("gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        state = RankState(WorkloadSpec(6 * MiB, tensors=6), init_device_mesh("cpu", (1,)))
        yield stores, state
    finally:
        dist.destroy_process_group()
        stores.__exit__(None, None, None)


@pytest.mark.parametrize("label", [
    "torch-fsspec-s3[block_size=16MiB,cache_type=None,thread_count=1]",
    "torch-fsspec-s3[block_size=128MiB,thread_count=4]",
    "s3torchconnector[part_size=8MiB,reader_constructor=range_based,thread_count=1]",
    "s3torchconnector[part_size=8MiB,reader_constructor=sequential,thread_count=1,"
    "throughput_target_gbps=25]",
])
def test_new_options_save_and_load_through_seaweedfs(
        seaweedfs_info: Any, label: str, monkeypatch: pytest.MonkeyPatch) -> None:
    stores, state = seaweedfs_info
    system = _require(label)
    info = stores.info["seaweedfs"]
    path = f"tune-{abs(hash(label)) % 10**8}"
    for key, value in systems.environment(OpContext(info, path, 0, 1)).items():
        monkeypatch.setenv(key, value)  # as the ranks get it
    try:
        for op in ("save", "load"):
            ctx = OpContext(info, path, 0, 1, options=options_for({}, label, op))
            prepared = (system.prepare_save if op == "save" else system.prepare_load)(
                ctx, state)
            try:
                prepared.run()
            finally:
                if prepared.close is not None:
                    prepared.close()
        assert state.verify(), f"{label}: the load is not bit-exact"
    finally:
        stores.delete("seaweedfs", path)
