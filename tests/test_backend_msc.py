"""The MSC backend: MSC profiles on a local S3 server (moto) and on a local directory.

Runs the conformance suite through both profiles, the feature flag (plain ``s3://``,
``gs://`` and local paths routed through MSC exactly as MSC resolves them), interop
with MSC's own ``MultiStorageFileSystemWriter``/``Reader``, clear errors for bad
configuration and unreachable/forbidden/missing storage, and a multi-process reshard.
"""

from __future__ import annotations

import http.server
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml

import dcpstore
from dcpstore.testing import BackendConformance, assert_state_equal, many_dtypes_state

msc = pytest.importorskip("multistorageclient")

from dcpstore_msc import (  # noqa: E402
    MSCBackend,
    MSCConfigError,
    ProfileNotFoundError,
    StorageNotFoundError,
)
from servers import S3Server, moto_server  # noqa: E402

BUCKET = "dcpstore-msc"
S3_PROFILE = "dcpstore-s3"
LOCAL_PROFILE = "dcpstore-local"


def s3_profile(server: S3Server, bucket: str = BUCKET, endpoint: str | None = None,
               **options: Any) -> dict[str, Any]:
    return {
        "storage_provider": {"type": "s3", "options": {
            "base_path": bucket, "endpoint_url": endpoint or server.endpoint_url,
            "region_name": server.region, "retries": {"max_attempts": 2},
            "connect_timeout": 5, "read_timeout": 30, **options}},
        "credentials_provider": {"type": "S3Credentials", "options": {
            "access_key": server.access_key, "secret_key": server.secret_key}},
    }


class MSCEnv:
    """The servers, directories and MSC config of this module."""

    def __init__(self, s3: S3Server, root: Path) -> None:
        self.s3 = s3
        self.local_dir = root / "local-profile"
        self.local_dir.mkdir()
        self.config: dict[str, Any] = {
            "profiles": {
                S3_PROFILE: s3_profile(s3),
                LOCAL_PROFILE: {"storage_provider": {
                    "type": "file", "options": {"base_path": str(self.local_dir)}}},
                "no-bucket": s3_profile(s3, bucket="no-such-bucket-msc"),
                "unreachable": s3_profile(s3, endpoint="http://127.0.0.1:9"),
            },
            "path_mapping": {
                f"s3://{BUCKET}-mapped/": f"msc://{S3_PROFILE}/",
                "gs://pretend-gcs-bucket/": f"msc://{LOCAL_PROFILE}/",
            },
        }
        self.config_file = root / "msc_config.yaml"
        self.config_file.write_text(yaml.safe_dump(self.config))


@pytest.fixture(scope="module")
def msc_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MSCEnv]:
    with moto_server() as s3, pytest.MonkeyPatch.context() as mp:
        s3.create_bucket(BUCKET)
        env = MSCEnv(s3, tmp_path_factory.mktemp("msc"))
        mp.setenv("MSC_CONFIG", str(env.config_file))
        mp.delenv("DCPSTORE_BACKEND", raising=False)
        yield env


def fresh(prefix: str = "ckpt") -> str:
    return f"{prefix}/{uuid.uuid4().hex[:12]}"


class TestMSCOnS3(BackendConformance):
    """msc://<profile on moto S3>/..., config found through MSC_CONFIG."""

    @pytest.fixture
    def checkpoint_uri(self, msc_env: MSCEnv) -> str:
        return f"msc://{S3_PROFILE}/{fresh()}"

    @pytest.fixture
    def backend_options(self, msc_env: MSCEnv) -> dict[str, Any]:
        return {"part_size": 64 * 1024}  # larger objects take the spool + upload_file path


class TestMSCOnLocalDirectory(BackendConformance):
    """msc://<POSIX profile>/..., config passed as a dict option."""

    @pytest.fixture
    def checkpoint_uri(self, msc_env: MSCEnv) -> str:
        return f"msc://{LOCAL_PROFILE}/{fresh()}"

    @pytest.fixture
    def backend_options(self, msc_env: MSCEnv) -> dict[str, Any]:
        return {"config": msc_env.config, "fsync": False}


# -- feature flag: plain URIs resolved as MSC resolves them ---------------------------------


def test_feature_flag_resolves_like_msc(msc_env: MSCEnv, monkeypatch: pytest.MonkeyPatch,
                                        tmp_path: Path) -> None:
    state = {"w": torch.randn(16, 4), "step": 3}
    s3_url = f"s3://{BUCKET}-mapped/{fresh('flag')}"  # path_mapping -> the S3 profile
    gs_url = f"gs://pretend-gcs-bucket/{fresh('flag')}"  # path_mapping -> the local profile
    local = str(tmp_path / "plain")  # MSC's implicit __filesystem__ profile
    for url in (s3_url, gs_url, local):
        writer = dcpstore.get_writer(url, backend="msc")
        assert isinstance(writer.backend, MSCBackend)
        client, path = msc.resolve_storage_client(url)
        assert (writer.backend.profile, writer.backend.root) == (client.profile, path.rstrip("/"))
        dcp.save(state, storage_writer=writer)
        out = {"w": torch.zeros(16, 4), "step": 0}
        dcpstore.load(out, url, backend="msc")
        assert_state_equal(out, state)
    # the bytes really are where MSC maps them
    s3 = msc_env.s3.client()
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=s3_url.split("/", 3)[3] + "/")
    assert any(o["Key"].endswith("/.metadata") for o in listed.get("Contents", []))
    assert (msc_env.local_dir / gs_url.split("/", 3)[3] / ".metadata").is_file()
    assert (Path(local) / ".metadata").is_file()
    # the environment flag does the same; explicit backend= beats it
    monkeypatch.setenv("DCPSTORE_BACKEND", "msc")
    assert isinstance(dcpstore.open_backend(s3_url), MSCBackend)
    assert type(dcpstore.open_backend(local, backend="file")).__name__ == "LocalBackend"


def test_config_option_path_and_dict(msc_env: MSCEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MSC_CONFIG")
    url = f"s3://{BUCKET}-mapped/{fresh('opt')}"
    be = dcpstore.open_backend(url, backend="msc", config=str(msc_env.config_file))
    assert (be.profile, be.root) == (S3_PROFILE, url.split("/", 3)[3])
    be.put("x", b"1")
    monkeypatch.setenv("DCPSTORE_MSC_CONFIG", str(msc_env.config_file))
    assert dcpstore.open_backend(f"msc://{S3_PROFILE}/{be.root}").get("x") == b"1"


# -- interop with MSC's own DCP integration -------------------------------------------------


def test_interop_with_msc_filesystem_writer_and_reader(msc_env: MSCEnv) -> None:
    from multistorageclient.contrib.torch import (
        MultiStorageFileSystemReader,
        MultiStorageFileSystemWriter,
    )

    state = many_dtypes_state(seed=3)
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    theirs = f"msc://{S3_PROFILE}/{fresh('interop-msc')}"
    dcp.save(tensors, storage_writer=MultiStorageFileSystemWriter(theirs), no_dist=True)
    out = {k: torch.zeros_like(v.contiguous()) for k, v in tensors.items()}
    dcpstore.load(out, theirs)
    assert_state_equal(out, tensors)

    ours = f"msc://{S3_PROFILE}/{fresh('interop-dcpstore')}"
    dcpstore.save(tensors, ours)
    back = {k: torch.zeros_like(v.contiguous()) for k, v in tensors.items()}
    dcp.load(back, storage_reader=MultiStorageFileSystemReader(ours), no_dist=True)
    assert_state_equal(back, tensors)


# -- bad input ------------------------------------------------------------------------------


def test_unknown_profile_lists_known_ones(msc_env: MSCEnv) -> None:
    with pytest.raises(ProfileNotFoundError, match=rf"'nope'.*msc_config.yaml.*{S3_PROFILE}"):
        dcpstore.get_writer("msc://nope/run")
    with pytest.raises(ProfileNotFoundError, match=LOCAL_PROFILE):
        dcpstore.get_reader("msc://nope/run", config=msc_env.config)
    assert issubclass(ProfileNotFoundError, LookupError)


def test_missing_config(msc_env: MSCEnv, monkeypatch: pytest.MonkeyPatch,
                        tmp_path: Path) -> None:
    for var in ("MSC_CONFIG", "XDG_CONFIG_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CONFIG_DIRS", str(tmp_path / "xdg"))
    with pytest.raises(MSCConfigError, match="no MSC configuration found.*MSC_CONFIG"):
        dcpstore.get_writer(f"msc://{S3_PROFILE}/run")
    with pytest.raises(MSCConfigError, match="does not exist"):
        dcpstore.get_writer(f"msc://{S3_PROFILE}/run", config=str(tmp_path / "absent.yaml"))
    monkeypatch.setenv("MSC_CONFIG", str(tmp_path / "broken.yaml"))
    (tmp_path / "broken.yaml").write_text("profiles: {x: {storage_provider: 7}}\n")
    with pytest.raises(MSCConfigError, match="invalid MSC configuration"):
        dcpstore.get_writer("msc://x/run")


def test_missing_bucket_commits_nothing(msc_env: MSCEnv) -> None:
    with pytest.raises(StorageNotFoundError, match="does not exist"):
        dcpstore.save({"w": torch.ones(4)}, "msc://no-bucket/run")
    with pytest.raises(StorageNotFoundError):
        dcpstore.load({"w": torch.ones(4)}, "msc://no-bucket/run")
    assert not isinstance(StorageNotFoundError("x"), FileNotFoundError)


def test_unreachable_endpoint_fails_fast(msc_env: MSCEnv) -> None:
    started = time.monotonic()
    with pytest.raises(ConnectionError, match="cannot reach the storage.*'unreachable'"):
        dcpstore.save({"w": torch.ones(4)}, "msc://unreachable/run")
    assert time.monotonic() - started < 20


class _Forbidden(http.server.BaseHTTPRequestHandler):
    """An S3 endpoint that refuses everything, with a request id."""

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        body = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code>'
                b"<Message>Access Denied</Message><RequestId>req-5678</RequestId></Error>")
        self.send_response(403)
        self.send_header("Content-Type", "application/xml")
        self.send_header("x-amz-request-id", "req-5678")
        self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _answer

    def log_message(self, *args: Any) -> None:
        pass


def test_permission_denied_keeps_request_id(msc_env: MSCEnv) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Forbidden)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        config = {"profiles": {"forbidden": s3_profile(msc_env.s3, endpoint=endpoint)}}
        with pytest.raises(PermissionError, match=r"permission denied.*req-5678"):
            dcpstore.save({"w": torch.ones(4)}, "msc://forbidden/run", config=config)
        be = dcpstore.open_backend("msc://forbidden/run", config=config)
        with pytest.raises(PermissionError, match="forbidden"):
            be.stat("x")
    finally:
        server.shutdown()
        server.server_close()


# -- multi-process ----------------------------------------------------------------------------


def _bad_input_on_every_rank(rank: int, world_size: int) -> list[str]:
    names = []
    for uri in ("msc://nope/run", "msc://no-bucket/run"):
        try:
            dcpstore.save({"w": torch.full((4,), float(rank))}, uri)
        except Exception as exc:
            names.append(type(exc).__name__)
    return names


@pytest.mark.multiprocess
def test_fsdp2_reshard_2_to_1_and_errors_on_every_rank(msc_env: MSCEnv) -> None:
    from fsdp_workers import load_fsdp, save_fsdp
    from mp import run_ranks

    uri = f"msc://{S3_PROFILE}/{fresh('fsdp')}/step-2"
    options = {"part_size": 256 * 1024}
    saved = run_ranks(save_fsdp, 2, uri, options)[0]
    loaded = run_ranks(load_fsdp, 1, uri, options)[0]
    assert_state_equal(loaded["model"], saved["model"])
    assert_state_equal(loaded["optim"], saved["optim"])
    names = run_ranks(_bad_input_on_every_rank, 2)
    assert names == [["ProfileNotFoundError", "StorageNotFoundError"]] * 2


@pytest.mark.multiprocess
def test_reshard_matrix_msc(msc_env: MSCEnv) -> None:
    """Save at 1, 2, 4 ranks, load at 1, 2, 3, 4 through the S3 profile."""
    from reshard_workers import run_matrix

    run_matrix(f"msc://{S3_PROFILE}/{fresh('matrix')}", {})
