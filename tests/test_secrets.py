"""Credentials never leak: not in DEBUG logs, error messages, reprs or CLI output.

Fake but recognizable credentials are planted for each store and looked for in
everything a user or a log collector could see:

- S3 (moto): an ``AKIA...`` access key id, a secret and a session token in the AWS
  environment; SeaweedFS (which checks them): its admin and read-only identities and a
  wrong secret, with saves refused for the read-only identity;
- GCS (fake-gcs-server): a service account with a freshly generated RSA key, given as a
  dict (``token=``) or a key file (``DCPSTORE_GS_TOKEN``), whose token endpoint is a
  local server handing out an access token that is then sent as the bearer token;
- MSC: a profile over moto whose ``credentials_provider`` carries keys and a session
  token, in the ``config`` option and in an ``MSC_CONFIG`` file;
- credential-bearing URLs (``s3://AKIA...:secret@bucket``, ``https://user:pass@host``
  endpoints as an option, in ``AWS_ENDPOINT_URL_S3`` or in an MSC profile) are refused
  without being echoed.

Searched: every log record at DEBUG on the root logger (botocore, urllib3, gcsfs,
fsspec, google.auth, aiohttp, multistorageclient, dcpstore, with tracebacks) through
saves, loads, a Checkpointer with async saves and failing operations (missing bucket,
missing checkpoint, unreachable endpoint, permission denied, wrong secret); the full
text of every exception (message, notes, ``__cause__``/``__context__`` chain);
``repr``/``str`` of writers, readers, backends, options and checkpointers; and the CLI
with ``--debug`` (in-process for every store, and one real subprocess).

Complements ``tests/test_backend_s3.py::test_secrets_never_leak`` (SeaweedFS wrong
secret) and ``::test_session_tokens_never_logged``.
"""

from __future__ import annotations

import http.server
import json
import logging
import os
import secrets
import subprocess
import sys
import threading
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from stores import GCS_TEST_BUCKET, S3_TEST_BUCKET

import dcpstore
from dcpstore.errors import BucketNotFoundError
from dcpstore.testing.servers import S3Server, isolate_env
from dcpstore.tools import cli
from dcpstore.tools.ops import verify_checkpoint

#: Loggers that must be captured at DEBUG (their records are what could leak).
CLIENT_LOGGERS = ("botocore", "urllib3", "gcsfs", "fsspec", "google", "google.auth",
                  "aiohttp", "multistorageclient", "dcpstore", "dcpstore_s3", "dcpstore_gcs",
                  "dcpstore_msc", "s3fs", "asyncio")


# -- capture -----------------------------------------------------------------------------


class _Collect(logging.Handler):
    """Keeps every record as a handler would write it (message and traceback)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
        self.lines: list[str] = []
        self.names: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        self.names.add(record.name)
        self.lines.append(self.format(record))


@dataclass
class Seen:
    """Everything collected during one test."""

    logs: _Collect
    texts: list[str] = field(default_factory=list)

    def error(self, fn: Callable[[], Any], *expected: type[BaseException]) -> BaseException:
        """Run ``fn``; it must raise one of ``expected``; keep everything it shows."""
        try:
            fn()
        except BaseException as exc:
            if expected and not isinstance(exc, expected):
                raise
            self.texts.append(_full_text(exc))
            return exc
        raise AssertionError(f"{fn} did not fail")

    def show(self, *objects: Any) -> None:
        self.texts += [t for o in objects for t in (repr(o), str(o))]

    def assert_clean(self, planted: dict[str, str]) -> None:
        everything = {"logs": "\n".join(self.logs.lines), **{
            f"text {i}": t for i, t in enumerate(self.texts)}}
        leaks = [(what, name, text[max(0, text.find(value) - 200):text.find(value) + 40])
                 for name, value in planted.items()
                 for what, text in everything.items() if value in text]
        assert not leaks, f"secrets leaked: {leaks[:3]}"


def _full_text(exc: BaseException) -> str:
    """An exception as a user sees it: message, notes, chain, DCP's rank failures."""
    text = "".join(traceback.format_exception(exc))
    for failure in getattr(exc, "failures", {}).values():
        err = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(err, BaseException):
            text += "".join(traceback.format_exception(err))
    return text


@pytest.fixture
def seen() -> Iterator[Seen]:
    """The root logger and every client logger at DEBUG, collected."""
    handler = _Collect()
    root = logging.getLogger()
    saved = (root.level, {n: logging.getLogger(n).level for n in CLIENT_LOGGERS})
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    for name in CLIENT_LOGGERS:
        logging.getLogger(name).setLevel(logging.DEBUG)
    try:
        yield Seen(handler)
    finally:
        root.removeHandler(handler)
        root.setLevel(saved[0])
        for name, level in saved[1].items():
            logging.getLogger(name).setLevel(level)


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A clean AWS environment with fake, recognizable credentials."""
    isolate_env(monkeypatch)
    planted = {
        "access key id": "AKIA" + secrets.token_hex(8).upper(),
        "secret": "Secret+" + secrets.token_urlsafe(30),
        "session token": "FwoGZXIvYXdzE" + secrets.token_urlsafe(90),
    }
    env = {"AWS_ACCESS_KEY_ID": planted["access key id"],
           "AWS_SECRET_ACCESS_KEY": planted["secret"],
           "AWS_SESSION_TOKEN": planted["session token"],
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
           "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return planted


def _roundtrip(uri: str, options: dict[str, Any], seen: Seen, *, root: str) -> None:
    """Save, load, a Checkpointer with a sync and an async save, and show every object."""
    state: dict[str, Any] = {"w": torch.randn(64, 64), "b": torch.arange(10),
                             "meta": {"lr": 0.1}}
    dcpstore.save(state, uri, **options)
    out: dict[str, Any] = {"w": torch.zeros(64, 64), "b": torch.zeros(10, dtype=torch.int64),
                           "meta": {"lr": 0.0}}
    dcpstore.load(out, uri, **options)
    assert torch.equal(out["w"], state["w"])
    with dcpstore.Checkpointer(root, keep_last=1, async_mode="thread", **options) as ckpt:
        ckpt.save(1, state)
        ckpt.save(2, state)
        ckpt.wait()
        assert ckpt.load(out) == 2
        seen.show(ckpt)
    writer = dcpstore.get_writer(uri, **options)
    reader = dcpstore.get_reader(uri, **options)
    seen.show(writer, reader, writer.backend, writer.backend.options, writer.options,
              reader.options, writer.backend.list())
    writer.backend.close()
    reader.backend.close()


def _cli_debug(seen: Seen, capsys: pytest.CaptureFixture[str], *argv: str) -> int:
    """``dcpstore --debug ...`` in-process; with --debug a failure propagates."""
    capsys.readouterr()
    try:
        code = cli.main(["--debug", *argv])
    except Exception as exc:
        seen.texts.append(_full_text(exc))
        code = 1
    captured = capsys.readouterr()
    seen.texts += [captured.out, captured.err]
    return code


# -- S3 ----------------------------------------------------------------------------------


def test_s3_credentials_never_leak(moto_s3: S3Server, aws_env: dict[str, str], seen: Seen,
                                   monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    run = f"s3://{S3_TEST_BUCKET}/secrets/{uuid.uuid4().hex[:8]}"
    options: dict[str, Any] = {"endpoint_url": moto_s3.endpoint_url}
    _roundtrip(f"{run}/ckpt", options, seen, root=f"{run}/steps")

    seen.error(lambda: dcpstore.load({"w": torch.zeros(1)}, "s3://dcpstore-no-such-bucket/x",
                                     **options), BucketNotFoundError)
    seen.error(lambda: dcpstore.load({"w": torch.zeros(1)}, f"{run}/none", **options),
               dcpstore.CheckpointNotFoundError)
    seen.error(lambda: dcpstore.save({"w": torch.ones(1)}, f"{run}/dead",
                                     endpoint_url="http://127.0.0.1:9", max_attempts=1,
                                     connect_timeout=2), ConnectionError)
    # credential-bearing URLs are refused without being echoed
    secret = aws_env["secret"]
    key_id = aws_env["access key id"]
    seen.error(lambda: dcpstore.open_backend(f"s3://{key_id}:{secret}@{S3_TEST_BUCKET}/x"),
               dcpstore.InvalidURIError)
    seen.error(lambda: dcpstore.get_writer(
        f"{run}/x", endpoint_url=f"https://{key_id}:{secret}@127.0.0.1:9"), ValueError)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://{key_id}:{secret}@127.0.0.1:9")
    seen.error(lambda: dcpstore.load({"w": torch.zeros(1)}, f"{run}/ckpt"), ValueError)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")

    assert _cli_debug(seen, capsys, "verify", f"{run}/ckpt", "-o",
                      f"endpoint_url={moto_s3.endpoint_url}") == 0
    assert _cli_debug(seen, capsys, "ls", "s3://dcpstore-no-such-bucket/x", "-o",
                      f"endpoint_url={moto_s3.endpoint_url}") == 1

    logs = "\n".join(seen.logs.lines)
    assert "Sending http request" in logs, "botocore's DEBUG records were not captured"
    assert "Credential=***" in logs and "X-Amz-Security-Token" in logs  # present, blanked
    seen.assert_clean(aws_env)


def test_s3_denied_and_wrong_secret_never_leak(seaweedfs_s3: S3Server, seen: Seen,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """SeaweedFS checks credentials: a read-only identity's save is refused, a wrong
    secret is refused; neither identity's keys show anywhere."""
    isolate_env(monkeypatch)
    server = seaweedfs_s3
    uri = f"s3://{S3_TEST_BUCKET}/secrets/{uuid.uuid4().hex[:8]}"
    options: dict[str, Any] = {"endpoint_url": server.endpoint_url, "max_attempts": 2}
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    dcpstore.save({"w": torch.randn(8)}, uri, **options)

    for name, value in server.env(readonly=True).items():
        monkeypatch.setenv(name, value)
    seen.error(lambda: dcpstore.save({"w": torch.randn(8)}, f"{uri}-2", **options),
               PermissionError)
    seen.error(lambda: dcpstore.save({"w": torch.randn(8)}, uri, overwrite=True, **options),
               PermissionError)
    out = {"w": torch.zeros(8)}
    dcpstore.load(out, uri, **options)  # reading is allowed

    wrong = "wrong+" + secrets.token_urlsafe(30)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
    seen.error(lambda: dcpstore.load({"w": torch.zeros(8)}, uri, **options), PermissionError)
    seen.error(lambda: verify_checkpoint(uri, **options), PermissionError)

    assert "Credential=***" in "\n".join(seen.logs.lines)
    assert server.readonly_access_key and server.readonly_secret_key
    seen.assert_clean({"admin key id": server.access_key, "admin secret": server.secret_key,
                       "reader key id": server.readonly_access_key,
                       "reader secret": server.readonly_secret_key, "wrong secret": wrong})


# -- GCS ---------------------------------------------------------------------------------


@dataclass
class ServiceAccount:
    """A fake service account whose token endpoint is a local server."""

    info: dict[str, str]
    key_file: Path
    access_token: str
    token_requests: list[str]

    def planted(self) -> dict[str, str]:
        key_lines = self.info["private_key"].splitlines()
        return {"access token": self.access_token,
                "private key id": self.info["private_key_id"],
                **{f"private key line {i}": line for i, line in enumerate(key_lines[1:4])}}


@pytest.fixture
def service_account(tmp_path: Path) -> Iterator[ServiceAccount]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    access_token = "ya29.local-" + secrets.token_urlsafe(40)
    requests_seen: list[str] = []

    class TokenEndpoint(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            requests_seen.append(self.path)
            body = json.dumps({"access_token": access_token, "expires_in": 3600,
                               "token_type": "Bearer"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), TokenEndpoint)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()).decode()
    info = {"type": "service_account", "project_id": "dcpstore-test",
            "private_key_id": secrets.token_hex(20), "private_key": pem,
            "client_email": "ckpt@dcpstore-test.iam.gserviceaccount.com",
            "client_id": "1" + secrets.token_hex(8),
            "token_uri": f"http://127.0.0.1:{server.server_port}/token"}
    key_file = tmp_path / "service-account.json"
    key_file.write_text(json.dumps(info))
    try:
        yield ServiceAccount(info, key_file, access_token, requests_seen)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_gcs_credentials_never_leak(gcs_server: Any, service_account: ServiceAccount,
                                    seen: Seen, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    isolate_env(monkeypatch)
    run = f"gs://{GCS_TEST_BUCKET}/secrets/{uuid.uuid4().hex[:8]}"
    # small parts: composite uploads, several requests per save
    options: dict[str, Any] = {"endpoint_url": gcs_server.endpoint_url,
                               "token": service_account.info, "part_size": 256 * 1024}
    _roundtrip(f"{run}/ckpt", options, seen, root=f"{run}/steps")
    assert service_account.token_requests, "the access token was never fetched"

    seen.error(lambda: dcpstore.load({"w": torch.zeros(1)},
                                     "gs://dcpstore-no-such-bucket/x", **options), OSError)
    seen.error(lambda: dcpstore.load({"w": torch.zeros(1)}, f"{run}/none", **options),
               dcpstore.CheckpointNotFoundError)
    seen.error(lambda: dcpstore.save({"w": torch.ones(1)}, f"{run}/dead",
                                     **{**options, "endpoint_url": "http://127.0.0.1:9",
                                        "max_attempts": 1, "timeout": 5}), OSError)
    leaky = f"http://svc:{service_account.access_token}@127.0.0.1:9"
    seen.error(lambda: dcpstore.open_backend(f"{run}/x", endpoint_url=leaky), ValueError)

    # the key file, as a user would configure the CLI
    monkeypatch.setenv("DCPSTORE_GS_TOKEN", str(service_account.key_file))
    monkeypatch.setenv("DCPSTORE_GS_ENDPOINT_URL", gcs_server.endpoint_url)
    assert _cli_debug(seen, capsys, "verify", f"{run}/ckpt") == 0
    assert _cli_debug(seen, capsys, "inspect", f"{run}/none") == 1

    assert {"gcsfs.credentials", "urllib3.connectionpool"} <= seen.logs.names
    seen.assert_clean(service_account.planted())


# -- MSC ---------------------------------------------------------------------------------


def _msc_profile(server: S3Server, planted: dict[str, str], *, bucket: str = S3_TEST_BUCKET,
                 endpoint: str | None = None) -> dict[str, Any]:
    return {
        "storage_provider": {"type": "s3", "options": {
            "base_path": bucket, "endpoint_url": endpoint or server.endpoint_url,
            "region_name": server.region, "retries": {"max_attempts": 1},
            "connect_timeout": 2, "read_timeout": 10}},
        "credentials_provider": {"type": "S3Credentials", "options": {
            "access_key": planted["access key id"], "secret_key": planted["secret"],
            "session_token": planted["session token"]}},
    }


def test_msc_credentials_never_leak(moto_s3: S3Server, seen: Seen, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("multistorageclient")
    isolate_env(monkeypatch)
    planted = {"access key id": "AKIA" + secrets.token_hex(8).upper(),
               "secret": "Secret+" + secrets.token_urlsafe(30),
               "session token": "FwoGZXIvYXdzE" + secrets.token_urlsafe(90)}
    config: dict[str, Any] = {"profiles": {
        "creds": _msc_profile(moto_s3, planted),
        "no-bucket": _msc_profile(moto_s3, planted, bucket="dcpstore-no-such-bucket"),
        "dead": _msc_profile(moto_s3, planted, endpoint="http://127.0.0.1:9"),
        "userinfo": _msc_profile(moto_s3, planted, endpoint=(
            f"http://{planted['access key id']}:{planted['secret']}@127.0.0.1:9")),
    }}
    run = f"secrets-msc/{uuid.uuid4().hex[:8]}"
    options: dict[str, Any] = {"config": config}
    _roundtrip(f"msc://creds/{run}/ckpt", options, seen, root=f"msc://creds/{run}/steps")

    seen.error(lambda: dcpstore.save({"w": torch.ones(1)}, f"msc://no-bucket/{run}",
                                     **options), OSError)
    seen.error(lambda: dcpstore.load({"w": torch.zeros(1)}, f"msc://dead/{run}", **options),
               OSError)
    seen.error(lambda: dcpstore.load({"w": torch.zeros(1)}, f"msc://userinfo/{run}",
                                     **options), ValueError)
    seen.error(lambda: dcpstore.load({"w": torch.zeros(1)}, f"msc://creds/{run}/none",
                                     **options), dcpstore.CheckpointNotFoundError)

    config_file = tmp_path / "msc_config.json"
    config_file.write_text(json.dumps(config))
    monkeypatch.setenv("MSC_CONFIG", str(config_file))
    assert _cli_debug(seen, capsys, "verify", f"msc://creds/{run}/ckpt") == 0
    assert _cli_debug(seen, capsys, "ls", f"msc://dead/{run}") == 1

    assert "Credential=***" in "\n".join(seen.logs.lines)
    seen.assert_clean(planted)


# -- the real command line -----------------------------------------------------------------


def test_cli_subprocess_debug_output(moto_s3: S3Server, aws_env: dict[str, str]) -> None:
    """``python -m dcpstore --debug``: the process's own logging setup prints every
    botocore record (signed requests included) on stderr, and the failure its traceback;
    no credential."""
    uri = f"s3://{S3_TEST_BUCKET}/secrets/{uuid.uuid4().hex[:8]}/missing"
    env = {**os.environ, "AWS_ENDPOINT_URL_S3": moto_s3.endpoint_url}
    proc = subprocess.run([sys.executable, "-m", "dcpstore", "--debug", "inspect", uri],
                          capture_output=True, text=True, env=env, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]
    assert "DEBUG botocore.endpoint" in output and "Credential=***" in output
    assert "Traceback" in output and "CheckpointNotFoundError" in output
    for name, value in aws_env.items():
        assert value not in output, f"{name} in the CLI's --debug output"


# -- encryption keys (SSE-C, CSEK) ----------------------------------------------------------


def _customer_key(tmp_path: Path, name: str) -> tuple[Path, dict[str, str]]:
    """A 32-byte key in a file, and the forms of it that must never show."""
    import base64

    key = secrets.token_bytes(32)
    path = tmp_path / name
    path.write_bytes(key)
    return path, {f"{name} base64": base64.b64encode(key).decode(),
                  f"{name} hex": key.hex(), f"{name} repr": repr(key)[2:-1]}


def test_s3_customer_key_never_leaks(seaweedfs_s3: S3Server, seen: Seen, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """SSE-C on SeaweedFS (which checks the key): saves, loads, a Checkpointer, loads with
    no key and with a wrong one, a key from an environment variable, the CLI."""
    isolate_env(monkeypatch)
    for name, value in seaweedfs_s3.env().items():
        monkeypatch.setenv(name, value)
    path, planted = _customer_key(tmp_path, "sse-c key")
    wrong_path, wrong = _customer_key(tmp_path, "wrong key")
    run = f"s3://{S3_TEST_BUCKET}/secrets-ssec/{uuid.uuid4().hex[:8]}"
    base: dict[str, Any] = {"endpoint_url": seaweedfs_s3.endpoint_url, "max_attempts": 2}
    options = {**base, "sse_customer_key_file": str(path)}
    _roundtrip(f"{run}/ckpt", options, seen, root=f"{run}/steps")
    seen.error(lambda: dcpstore.load({"w": torch.zeros(64, 64)}, f"{run}/ckpt", **base),
               PermissionError)
    seen.error(lambda: dcpstore.load({"w": torch.zeros(64, 64)}, f"{run}/ckpt", **base,
                                     sse_customer_key_file=str(wrong_path)), PermissionError)
    monkeypatch.setenv("CKPT_SSE_KEY", planted["sse-c key base64"])
    out = {"w": torch.zeros(64, 64)}
    dcpstore.load(out, f"{run}/ckpt", **base, sse_customer_key_env="CKPT_SSE_KEY")
    seen.show(dcpstore.open_backend(f"{run}/ckpt", **base, sse_customer_key_env="CKPT_SSE_KEY"))
    assert _cli_debug(seen, capsys, "verify", f"{run}/ckpt", "-o",
                      f"endpoint_url={seaweedfs_s3.endpoint_url}", "-o",
                      f"sse_customer_key_file={path}") == 0
    assert _cli_debug(seen, capsys, "verify", f"{run}/ckpt", "--json", "-o",
                      f"endpoint_url={seaweedfs_s3.endpoint_url}", "-o",
                      f"sse_customer_key_file={wrong_path}") == 1

    logs = "\n".join(seen.logs.lines)
    assert "x-amz-server-side-encryption-customer-key" in logs.lower()  # present, blanked
    seen.assert_clean({**planted, **wrong})


def test_gcs_customer_key_never_leaks(gcs_server: Any, seen: Seen, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    isolate_env(monkeypatch)
    path, planted = _customer_key(tmp_path, "csek")
    run = f"gs://{GCS_TEST_BUCKET}/secrets-csek/{uuid.uuid4().hex[:8]}"
    options: dict[str, Any] = {"endpoint_url": gcs_server.endpoint_url, "token": "anon",
                               "part_size": 256 * 1024, "encryption_key_file": str(path)}
    _roundtrip(f"{run}/ckpt", options, seen, root=f"{run}/steps")
    seen.error(lambda: dcpstore.load({"w": torch.zeros(1)}, f"{run}/none", **options),
               dcpstore.CheckpointNotFoundError)
    monkeypatch.setenv("DCPSTORE_GS_ENCRYPTION_KEY_FILE", str(path))
    monkeypatch.setenv("DCPSTORE_GS_ENDPOINT_URL", gcs_server.endpoint_url)
    assert _cli_debug(seen, capsys, "verify", f"{run}/ckpt", "--json") == 0
    seen.assert_clean(planted)
