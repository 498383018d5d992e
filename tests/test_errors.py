"""One exception class per kind of failure, kept whole when it crosses ranks; plugins
written against the public contract only."""

from __future__ import annotations

import ast
import errno
import pickle
from pathlib import Path

import pytest

from dcpstore import errors
from dcpstore.dcp import read_share

REPO = Path(__file__).resolve().parents[1]

STORE_KINDS = [
    (errors.ObjectNotFoundError, FileNotFoundError, errno.ENOENT, False),
    (errors.BucketNotFoundError, OSError, errno.ENOENT, False),
    (errors.AccessDeniedError, PermissionError, errno.EACCES, False),
    (errors.StoreThrottledError, OSError, errno.EAGAIN, True),
    (errors.StoreTimeoutError, TimeoutError, errno.ETIMEDOUT, True),
    (errors.StoreUnavailableError, ConnectionError, errno.ECONNRESET, True),
    (errors.ObjectTooLargeError, OSError, errno.EFBIG, False),
    (errors.PreconditionFailedError, FileExistsError, errno.EEXIST, False),
]


@pytest.mark.parametrize(("kind", "base", "number", "retryable"), STORE_KINDS)
def test_store_kinds(kind: type[errors.StoreError], base: type[BaseException], number: int,
                     retryable: bool) -> None:
    exc = kind("s3://b/k: what went wrong; what to do", request_id="REQ-1")
    assert isinstance(exc, base) and isinstance(exc, errors.DcpstoreError)
    assert exc.errno == number and exc.retryable is retryable
    assert str(exc) == "s3://b/k: what went wrong; what to do (request id REQ-1)"
    again = pickle.loads(pickle.dumps(exc))  # a process-mode save's worker sends it back
    assert type(again) is kind and again.request_id == "REQ-1" and again.errno == number
    assert kind("x", retryable=not retryable).retryable is not retryable


@pytest.mark.parametrize(("kind", "base", "number", "retryable"), STORE_KINDS)
def test_errors_crossing_ranks_keep_class_errno_and_request_id(
        kind: type[errors.StoreError], base: type[BaseException], number: int,
        retryable: bool) -> None:
    sent = kind(number, "gs://b/k: no", request_id="abc")
    got = errors.decode_error(errors.encode_error(sent), " (on rank 0)")
    assert type(got) is kind and isinstance(got, base)
    assert got.errno == number and got.request_id == "abc"  # type: ignore[attr-defined]
    assert "gs://b/k: no (on rank 0)" in str(got)
    # the read-sharing broadcast uses the same encoding
    shared = read_share._error_from_payload(read_share._error_payload(sent), 0)
    assert type(shared) is kind and shared.request_id == "abc"  # type: ignore[attr-defined]


def test_other_errors_crossing_ranks() -> None:
    for sent in (FileNotFoundError(errno.ENOENT, "gone"), ValueError("bad value"),
                 errors.IntegrityError("crc mismatch"), errors.ConfigurationError("no bucket")):
        got = errors.decode_error(errors.encode_error(sent))
        assert type(got) is type(sent) and str(sent) in str(got)
        assert getattr(got, "errno", None) == getattr(sent, "errno", None)

    class Private(Exception):
        pass

    got = errors.decode_error(errors.encode_error(Private("boom")))
    assert type(got) is errors.DcpstoreError and str(got) == "Private: boom"


def _private_names_of_dcpstore(path: Path) -> list[str]:
    """``dcpstore`` names starting with ``_`` that ``path`` imports or reaches."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and (
                node.module == "dcpstore" or node.module.startswith("dcpstore.")):
            parts = node.module.split(".")
            found += [f"{path.name}:{node.lineno} {node.module}" for p in parts if
                      p.startswith("_") and not p.startswith("__")]
            found += [f"{path.name}:{node.lineno} {a.name}" for a in node.names
                      if a.name.startswith("_")]
    return found


@pytest.mark.parametrize("plugin", sorted(p.name for p in (REPO / "backends").iterdir()
                                          if (p / "pyproject.toml").exists()))
def test_plugins_use_only_public_names_of_dcpstore(plugin: str) -> None:
    sources = sorted((REPO / "backends" / plugin).glob("dcpstore_*/*.py"))
    assert sources
    offenders = [hit for path in sources for hit in _private_names_of_dcpstore(path)]
    assert offenders == []
    # and a plugin subclasses the public contract, not the framework's Backend
    text = "\n".join(p.read_text() for p in sources)
    assert "ObjectStore" in text or "MultipartStore" in text
    assert "(Backend)" not in text and "(MultipartUpload)" not in text
    framework_privates = ("._call(", "._lazy(", "._resources", "._concurrency(",
                          "._executor(", "._failure(")
    assert [name for name in framework_privates if name in text] == []
