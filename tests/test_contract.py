"""The plugin contract's conformance checks: a store written only against
``dcpstore.plugin`` (the example of docs/writing-a-backend.md, run as written) passes
the whole suite, the non-HTTP error tests included; deliberately broken stores fail the
check of the rule they break, with a message naming the method and the rule."""

from __future__ import annotations

import re
import sqlite3
import sys
import types
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import dcpstore
from dcpstore.errors import StoreThrottledError, StoreUnavailableError
from dcpstore.plugin import ObjectInfo, ObjectStore, register_backend
from dcpstore.testing import BackendConformance
from dcpstore.testing.conformance.contract import (
    CHECKS,
    ContractTests,
    ContractViolation,
    check_faults,
)

DOC = Path(__file__).resolve().parents[1] / "docs" / "writing-a-backend.md"


def _doc_example() -> types.ModuleType:
    """The doc's example plugin, executed as a module of its own (importable by name,
    so pickling its classes works)."""
    name = "dcpstore_doc_sqlite_example"
    if name in sys.modules:
        return sys.modules[name]
    text = DOC.read_text()
    match = re.search(r"<!-- example: sqlite-store -->\s*```python\n(.*?)\n```", text, re.S)
    assert match, f"{DOC} lost its example plugin block"
    module = types.ModuleType(name)
    module.__file__ = str(DOC)
    sys.modules[name] = module
    exec(compile(match.group(1), f"{DOC}:sqlite-store", "exec"), module.__dict__)
    return module


example = _doc_example()
SQLiteStore: type[ObjectStore] = example.SQLiteStore


@pytest.fixture(autouse=True)
def _sqlite_scheme() -> None:
    """The doc's plugin serves sqlite:// (registered per test: other tests reset the
    registry)."""
    register_backend("sqlite", SQLiteStore, clobber=True)


def _sqlite_error(message: str, code: int) -> sqlite3.OperationalError:
    exc = sqlite3.OperationalError(message)
    exc.sqlite_errorcode = code  # type: ignore[attr-defined]
    return exc


class TestDocExamplePlugin(BackendConformance):
    """The doc's SQLite store, through the whole suite (ContractTests included)."""

    @pytest.fixture
    def checkpoint_uri(self, tmp_path: Path) -> str:
        return f"sqlite://{tmp_path}/runs.db/{uuid.uuid4().hex}"

    @pytest.fixture
    def backend_options(self) -> dict[str, Any]:
        return {"busy_timeout": 1.0, "part_size": 64 * 1024}

    @pytest.fixture
    def store_faults(self) -> dict[str, BaseException]:
        return {"throttled": _sqlite_error("database is locked", sqlite3.SQLITE_BUSY),
                "denied": _sqlite_error("attempt to write a readonly database",
                                        sqlite3.SQLITE_READONLY),
                "too_large": _sqlite_error("string or blob too big", sqlite3.SQLITE_TOOBIG)}


# -- the example is a real plugin -------------------------------------------------------------


def test_doc_example_saves_and_loads_through_the_public_api(tmp_path: Path) -> None:
    state = {"w": torch.randn(300, 70), "n": 4}
    uri = f"sqlite://{tmp_path}/runs.db/run7/step-1"
    dcpstore.save(state, uri, part_size=16 * 1024)
    out = {"w": torch.zeros(300, 70), "n": 0}
    dcpstore.load(out, uri)
    assert torch.equal(out["w"], state["w"]) and out["n"] == 4
    root = dcpstore.open_backend(f"sqlite://{tmp_path}/runs.db?busy_timeout=2")
    try:
        assert root.options.busy_timeout == 2.0
        assert root.list_dirs("") == ["run7"] and root.list_dirs("run7/") == ["step-1"]
    finally:
        root.close()


def test_a_really_locked_database_is_throttled(tmp_path: Path) -> None:
    store = SQLiteStore(f"{tmp_path}/x.db", SQLiteStore.Options(busy_timeout=0.0))
    store.put("k", memoryview(b"1"))
    other = sqlite3.connect(f"{tmp_path}/x.db", isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(sqlite3.OperationalError) as info:
            store.put("k", memoryview(b"2"))
        mapped = store.map_error(info.value, "k")
        assert isinstance(mapped, StoreThrottledError) and mapped.retryable
    finally:
        other.execute("ROLLBACK")
        other.close()
        store.release()


# -- broken stores fail the check of the rule they break --------------------------------------


class ShortRead(SQLiteStore):  # type: ignore[misc,valid-type]
    """Fills only the first buffer and returns."""

    def read(self, key: str, offset: int = 0, buffers: Any = None) -> Any:
        if buffers is None:
            return super().read(key, offset)
        return super().read(key, offset, buffers[:1])


class NoEOF(SQLiteStore):  # type: ignore[misc,valid-type]
    """Copies what there is and returns where the object ends early."""

    def read(self, key: str, offset: int = 0, buffers: Any = None) -> Any:
        if buffers is None:
            return super().read(key, offset)
        data = super().read(key)[offset:]
        for buf in buffers:
            chunk, data = data[:len(buf)], data[len(buf):]
            buf[:len(chunk)] = chunk
        return None


class RepeatedKeys(SQLiteStore):  # type: ignore[misc,valid-type]
    def list(self, prefix: str, **kw: Any) -> Iterator[Any]:
        entries = list(super().list(prefix, **kw))
        yield from entries
        yield from (e for e in entries if isinstance(e, ObjectInfo))


class OutsidePrefix(SQLiteStore):  # type: ignore[misc,valid-type]
    def list(self, prefix: str, **kw: Any) -> Iterator[Any]:
        return super().list(prefix.rpartition("/")[0], **kw)


class WrongHead(SQLiteStore):  # type: ignore[misc,valid-type]
    def head(self, key: str) -> ObjectInfo:
        info = super().head(key)
        return ObjectInfo("x/" + key, info.size, info.mtime)


class WrongSize(SQLiteStore):  # type: ignore[misc,valid-type]
    def head(self, key: str) -> ObjectInfo:
        info = super().head(key)
        return ObjectInfo(key, info.size + 1, info.mtime)


class UnknownNotFound(SQLiteStore):  # type: ignore[misc,valid-type]
    """Its map_error does not know its own not-found error."""

    def map_error(self, exc: Exception, key: str | None) -> Any:
        return None if isinstance(exc, example.NoSuchKey) else super().map_error(exc, key)


class KeepsData(SQLiteStore):  # type: ignore[misc,valid-type]
    """Keeps the caller's buffer instead of a copy (a dict store's classic bug)."""

    kept: dict[str, memoryview] = {}

    def put(self, key: str, data: memoryview) -> None:
        self.kept[key] = data

    def read(self, key: str, offset: int = 0, buffers: Any = None) -> Any:
        if key in self.kept and buffers is None:
            return bytes(self.kept[key][offset:])
        return super().read(key, offset, buffers)


@pytest.mark.parametrize(("store_cls", "check", "message"), [
    (ShortRead, "read", "ShortRead.read: no short reads: fill every buffer, in order, or "
                        "raise EOFError"),
    (NoEOF, "read", "NoEOF.read: no short reads: the object ends before the buffers are "
                    "full and read returned without raising EOFError"),
    (RepeatedKeys, "list", "RepeatedKeys.list: each key once: list('contract-checks/l/') "
                           "repeats"),
    (OutsidePrefix, "list", "OutsidePrefix.list: only keys under the prefix"),
    (WrongHead, "head", "WrongHead.head: ObjectInfo.key is the key asked for"),
    (WrongSize, "head", "WrongSize.head: ObjectInfo.size is the object's size"),
    (UnknownNotFound, "missing_object", "UnknownNotFound.map_error: map the store's own "
                                        "not-found error to ObjectNotFoundError: it "
                                        "returned None"),
    (KeepsData, "put", "KeepsData.put: store a copy: data is a reused buffer"),
])
def test_broken_store_fails_naming_method_and_rule(tmp_path: Path, store_cls: type,
                                                   check: str, message: str) -> None:
    store = store_cls(f"{tmp_path}/broken.db")
    try:
        with pytest.raises(ContractViolation) as info:
            CHECKS[check](store)
        assert str(info.value).startswith(message), str(info.value)
        # the same through the suite's pytest class
        with pytest.raises(ContractViolation, match=re.escape(message)):
            ContractTests().test_contract_rule(store_cls(f"{tmp_path}/again.db"), check)
    finally:
        store.release()


def test_every_rule_passes_on_the_correct_store(tmp_path: Path) -> None:
    store = SQLiteStore(f"{tmp_path}/ok.db/prefix")
    try:
        for check in CHECKS.values():
            check(store)
    finally:
        store.release()


class Misclassified(SQLiteStore):  # type: ignore[misc,valid-type]
    def map_error(self, exc: Exception, key: str | None) -> Any:
        if getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_BUSY:
            return StoreUnavailableError(f"{key}: locked")
        return super().map_error(exc, key)


def test_misclassified_fault_fails_naming_map_error_and_the_kind(tmp_path: Path) -> None:
    faults = {"throttled": _sqlite_error("database is locked", sqlite3.SQLITE_BUSY)}
    check_faults(SQLiteStore(f"{tmp_path}/a.db"), faults)
    with pytest.raises(ContractViolation,
                       match=r"^Misclassified\.map_error: map the SDK's throttled error to "
                             r"StoreThrottledError: .*StoreUnavailableError"):
        check_faults(Misclassified(f"{tmp_path}/b.db"), faults)
    with pytest.raises(ValueError, match="unknown kind 'slow'"):
        check_faults(SQLiteStore(f"{tmp_path}/c.db"), {"slow": RuntimeError()})
