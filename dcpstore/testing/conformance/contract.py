"""Conformance: the plugin contract's rules, checked on the :class:`ObjectStore` itself.

The other conformance modules test a store through the framework, where a broken rule
surfaces as a corrupt checkpoint far from its cause. These checks call the plugin's
methods directly (``backend.store``) and, when a rule is broken, fail with a
:class:`ContractViolation` that names the method and the rule::

    DictStore.read: no short reads: the object ends before the buffers are full and
    read returned without raising EOFError (offset 9990, 20 bytes asked, ...)

Each check is also a plain function (``check_read(store)``, ...), to run on a store
outside pytest. A backend that is not a plugin (an old-style ``Backend`` subclass)
skips them with the reason.

The fault hook ``store_faults`` (see :class:`ConformanceBase`) gives, by kind, an
exception the store's SDK raises (throttled, timeout, denied, ...); the suite checks
what :meth:`~ObjectStore.map_error` makes of each (class, ``retryable``) and that the
framework retries a throttled request and then succeeds, without HTTP.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import pytest

import dcpstore
from dcpstore import errors
from dcpstore.storage.backend import Backend, ObjectInfo, Upload
from dcpstore.storage.contract import MultipartStore, ObjectStore
from dcpstore.storage.store_backend import StoreBackend
from dcpstore.testing.conformance._base import ConformanceBase, payload

__all__ = [
    "CHECKS",
    "FAULT_KINDS",
    "ContractTests",
    "ContractViolation",
    "check_delete",
    "check_faults",
    "check_head",
    "check_list",
    "check_missing_object",
    "check_multipart",
    "check_open_stream",
    "check_put",
    "check_read",
]

#: What ``map_error`` must make of each kind of ``store_faults``: (class, retryable).
FAULT_KINDS: dict[str, tuple[type[errors.StoreError], bool]] = {
    "throttled": (errors.StoreThrottledError, True),
    "timeout": (errors.StoreTimeoutError, True),
    "unavailable": (errors.StoreUnavailableError, True),
    "denied": (errors.AccessDeniedError, False),
    "not_found": (errors.ObjectNotFoundError, False),
    "missing_bucket": (errors.BucketNotFoundError, False),
    "too_large": (errors.ObjectTooLargeError, False),
    "precondition": (errors.PreconditionFailedError, False),
}

#: The retryable kinds, in the order the retry test prefers them.
_RETRYABLE = ("throttled", "unavailable", "timeout")

_ROOT = "contract-checks"
_FAST_RETRY = {"retry_backoff": 0.001, "retry_backoff_max": 0.002}


class ContractViolation(AssertionError):
    """A plugin broke a rule of the contract: the message names the method and the
    rule."""


def _fail(store: ObjectStore, method: str, rule: str, detail: str) -> NoReturn:
    raise ContractViolation(f"{type(store).__name__}.{method}: {rule}: {detail}")


def _not(expected: bytes) -> bytearray:
    """A buffer whose every byte differs from ``expected`` (a partial fill shows)."""
    return bytearray(b ^ 0xFF for b in expected)


def _first_difference(a: bytes, b: bytes) -> int:
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


def _listing(store: ObjectStore, prefix: str, **kw: Any) -> list[ObjectInfo | str]:
    try:
        return list(store.list(prefix, **kw))
    except Exception as exc:
        _fail(store, "list", "a prefix without objects lists nothing, without error"
              if prefix.endswith("empty/") else "list the objects under a prefix",
              f"list({prefix!r}, {kw}) raised {exc!r}")


# -- the checks ----------------------------------------------------------------------


def check_read(store: ObjectStore) -> None:
    """``read``: the whole object or from ``offset`` without buffers (bytes);
    into buffers exactly, in order, returning ``None``; ``EOFError``, never a short
    read, where the object ends before the buffers are full."""
    key = f"{_ROOT}/read.bin"
    data = payload(10_000, seed=11)
    store.put(key, memoryview(data))
    got = store.read(key)
    if not isinstance(got, (bytes, bytearray, memoryview)) or bytes(got) != data:
        _fail(store, "read", "without buffers, return the whole object's bytes",
              f"read({key!r}) returned {type(got).__name__} of "
              f"{len(got) if isinstance(got, (bytes, bytearray, memoryview)) else '?'} "
              f"bytes, the object holds {len(data)}")
    got = store.read(key, 100)
    if got is None or bytes(got) != data[100:]:
        _fail(store, "read", "without buffers, return the bytes from offset to the end",
              f"read({key!r}, 100) returned {None if got is None else len(got)} bytes, "
              f"expected {len(data) - 100}")
    offset, sizes = 200, (3, 0, 5000, 1, 4000)
    expected = data[offset:offset + sum(sizes)]
    bufs, pos = [], 0
    for n in sizes:
        bufs.append(memoryview(_not(expected[pos:pos + n])))
        pos += n
    answer = store.read(key, offset, bufs)
    filled = b"".join(bytes(b) for b in bufs)
    if filled != expected:
        at = _first_difference(filled, expected)
        _fail(store, "read", "no short reads: fill every buffer, in order, or raise EOFError",
              f"read({key!r}, {offset}, buffers of {list(sizes)} bytes) returned with "
              f"byte {at} of {len(expected)} not filled with the object's byte "
              f"{offset + at}")
    if answer is not None:
        _fail(store, "read", "with buffers, return None (the buffers hold the bytes)",
              f"read({key!r}, {offset}, buffers) returned {type(answer).__name__}")
    for offset, size in ((len(data) - 10, 20), (len(data), 1)):
        buf = memoryview(bytearray(size))
        try:
            store.read(key, offset, [buf])
        except EOFError:
            continue
        except Exception as exc:
            _fail(store, "read", "an object that ends before the buffers are full is an "
                  "EOFError", f"read({key!r}, {offset}, {size} bytes) of a {len(data)}-byte "
                  f"object raised {exc!r}")
        _fail(store, "read", "no short reads: the object ends before the buffers are full "
              "and read returned without raising EOFError",
              f"read({key!r}, {offset}, {size} bytes) of a {len(data)}-byte object")


def check_put(store: ObjectStore) -> None:
    """``put``: replaces an object whole, keeps no reference to ``data``, stores an
    empty object."""
    key = f"{_ROOT}/put.bin"
    first = bytearray(b"first version")
    store.put(key, memoryview(first))
    first[:] = b"X" * len(first)  # the framework reuses its buffers
    got = store.read(key)
    if got is None or bytes(got) != b"first version":
        _fail(store, "put", "store a copy: data is a reused buffer, never keep it after "
              "returning", f"after put({key!r}) the caller changed its buffer and the "
              f"object reads {bytes(got or b'')[:20]!r}")
    store.put(key, memoryview(b"second, longer version"))
    if bytes(store.read(key) or b"") != b"second, longer version":
        _fail(store, "put", "replace an object there whole", f"a second put({key!r}) "
              "did not replace the first")
    store.put(f"{_ROOT}/empty", memoryview(b""))
    empty = store.read(f"{_ROOT}/empty")
    if store.head(f"{_ROOT}/empty").size != 0 or empty is None or len(empty):
        _fail(store, "put", "store an empty object", f"put({_ROOT + '/empty'!r}, b'') did "
              "not read back as 0 bytes")


def check_head(store: ObjectStore) -> None:
    """``head``: an :class:`ObjectInfo` of the key asked for, with its size."""
    key = f"{_ROOT}/head.bin"
    store.put(key, memoryview(payload(1234, seed=12)))
    info = store.head(key)
    if not isinstance(info, ObjectInfo):
        _fail(store, "head", "return an ObjectInfo", f"head({key!r}) returned {info!r}")
    if info.key != key:
        _fail(store, "head", "ObjectInfo.key is the key asked for (relative to the "
              "location)", f"head({key!r}) returned key {info.key!r}")
    if info.size != 1234:
        _fail(store, "head", "ObjectInfo.size is the object's size in bytes",
              f"head({key!r}) returned size {info.size}, the object holds 1234 bytes")


def _mapped_not_found(store: ObjectStore, method: str, call: Callable[[], Any],
                      key: str) -> None:
    try:
        answer = call()
    except EOFError as exc:
        _fail(store, method, "a missing object raises the store's not-found error (an "
              "EOFError means an object that is too short)", f"{method}({key!r}) of a "
              f"missing object raised {exc!r}")
    except errors.ObjectNotFoundError:
        return  # already the kind (the framework passes dcpstore errors unchanged)
    except errors.DcpstoreError as exc:
        _fail(store, method, "a missing object is an ObjectNotFoundError",
              f"{method}({key!r}) of a missing object raised {exc!r}")
    except Exception as exc:
        mapped = store.map_error(exc, key)
        if mapped is None:
            _fail(store, "map_error", "map the store's own not-found error to "
                  "ObjectNotFoundError", f"it returned None (an exception it does not "
                  f"know) for {exc!r}, raised by {method}({key!r}) of a missing object")
        if not isinstance(mapped, errors.ObjectNotFoundError):
            _fail(store, "map_error", "map the store's own not-found error to "
                  "ObjectNotFoundError", f"it returned {mapped!r} for {exc!r}, raised by "
                  f"{method}({key!r}) of a missing object")
        if key not in str(mapped):
            _fail(store, "map_error", "the message names the object",
                  f"{str(mapped)!r} does not name {key!r}")
        return
    _fail(store, method, "a missing object raises the store's not-found error",
          f"{method}({key!r}) of a missing object returned {answer!r}")


class _Foreign(Exception):
    """An exception no store knows."""


def check_missing_object(store: ObjectStore) -> None:
    """``head`` / ``read`` of a missing object raise what ``map_error`` maps to
    :class:`ObjectNotFoundError` (naming the object); an exception ``map_error`` does
    not know gives ``None`` (or a kind), never an error of its own."""
    key = f"{_ROOT}/missing.bin"
    _mapped_not_found(store, "head", lambda: store.head(key), key)
    _mapped_not_found(store, "read", lambda: store.read(key), key)
    _mapped_not_found(store, "read", lambda: store.read(key, 0, [memoryview(bytearray(4))]),
                      key)
    try:
        answer = store.map_error(_Foreign("no store raises this"), key)
    except Exception as exc:
        _fail(store, "map_error", "return None for an exception it does not know",
              f"map_error(_Foreign(...)) raised {exc!r}")
    kinds = (errors.StoreError, errors.ConfigurationError)
    if answer is not None and not isinstance(answer, kinds):
        _fail(store, "map_error", "return a StoreError kind, a ConfigurationError or None",
              f"map_error(_Foreign(...)) returned {answer!r}")


def check_list(store: ObjectStore) -> None:
    """``list``: recursive without a delimiter (every object under the prefix, each
    once, nothing outside it, sizes right); one level with ``delimiter="/"`` (the
    objects directly under it, each deeper name once, without the prefix or a ``/``);
    ``start_after`` never drops a greater key."""
    base = f"{_ROOT}/l"
    objects = {f"{base}/a/1": 1, f"{base}/a/2": 2, f"{base}/b/deep/1": 3, f"{base}/c": 4,
               f"{base}x": 5, f"{_ROOT}/other": 6}
    for key, size in objects.items():
        store.put(key, memoryview(b"x" * size))
    for prefix in (f"{base}/", base, f"{base}/a"):
        entries = _listing(store, prefix)
        want = {k: s for k, s in objects.items() if k.startswith(prefix)}
        seen: set[str] = set()
        for entry in entries:
            if not isinstance(entry, ObjectInfo):
                _fail(store, "list", "without a delimiter, every entry is an ObjectInfo",
                      f"list({prefix!r}) gave {entry!r}")
            if entry.key in seen:
                _fail(store, "list", "each key once", f"list({prefix!r}) repeats "
                      f"{entry.key!r}")
            seen.add(entry.key)
            if not entry.key.startswith(prefix):
                _fail(store, "list", "only keys under the prefix", f"list({prefix!r}) "
                      f"gave {entry.key!r}")
            if entry.key in want and entry.size != want[entry.key]:
                _fail(store, "list", "ObjectInfo.size is the object's size",
                      f"list({prefix!r}) gave {entry.key!r} size {entry.size}, expected "
                      f"{want[entry.key]}")
        missing = sorted(set(want) - seen)
        if missing:
            _fail(store, "list", "every object under the prefix, recursively",
                  f"list({prefix!r}) left out {missing}")
    prefix = f"{base}/"
    entries = _listing(store, prefix, delimiter="/")
    names: list[str] = []
    keys: list[str] = []
    for entry in entries:
        if isinstance(entry, str):
            if "/" in entry or not entry or entry.startswith(prefix):
                _fail(store, "list", "with delimiter='/', a deeper level is its name "
                      "below the prefix, without the prefix or a '/'",
                      f"list({prefix!r}, delimiter='/') gave {entry!r}")
            if entry in names:
                _fail(store, "list", "with delimiter='/', each name once",
                      f"list({prefix!r}, delimiter='/') repeats {entry!r}")
            names.append(entry)
        elif isinstance(entry, ObjectInfo):
            if entry.key in keys:
                _fail(store, "list", "each key once", f"list({prefix!r}, delimiter='/') "
                      f"repeats {entry.key!r}")
            keys.append(entry.key)
        else:
            _fail(store, "list", "entries are ObjectInfo or str",
                  f"list({prefix!r}, delimiter='/') gave {entry!r}")
    if sorted(names) != ["a", "b"] or keys != [f"{base}/c"]:
        _fail(store, "list", "with delimiter='/', one level: the objects directly under "
              "the prefix and each deeper name once", f"list({prefix!r}, delimiter='/') "
              f"gave objects {sorted(keys)} and names {sorted(names)}, expected "
              f"[{base + '/c'!r}] and ['a', 'b']")
    after = f"{base}/a/1"
    got = {e.key for e in _listing(store, prefix, start_after=after)
           if isinstance(e, ObjectInfo)}
    lost = sorted(k for k in objects if k.startswith(prefix) and k > after and k not in got)
    if lost:
        _fail(store, "list", "start_after only lets the store skip keys up to it",
              f"list({prefix!r}, start_after={after!r}) left out {lost}")
    if _listing(store, f"{_ROOT}/empty/") or _listing(store, f"{_ROOT}/empty/",
                                                       delimiter="/"):
        _fail(store, "list", "a prefix without objects lists nothing",
              f"list({_ROOT + '/empty/'!r}) gave entries")


def check_delete(store: ObjectStore) -> None:
    """``delete``: removes the keys; a missing key is not an error; idempotent."""
    keys = [f"{_ROOT}/del/1", f"{_ROOT}/del/2"]
    for key in keys:
        store.put(key, memoryview(b"x"))
    for attempt in ("", " (again: idempotent)"):
        try:
            store.delete([*keys, f"{_ROOT}/del/never-there"])
        except Exception as exc:
            _fail(store, "delete", "a missing key is not an error" + attempt,
                  f"delete raised {exc!r}")
    left = [e for e in _listing(store, f"{_ROOT}/del/") if isinstance(e, ObjectInfo)]
    if left:
        _fail(store, "delete", "delete the keys", f"{[e.key for e in left]} still listed")


def check_multipart(store: ObjectStore) -> None:
    """A :class:`MultipartStore`: parts uploaded in any order (kept by copy) and
    assembled in order by ``complete_upload``; ``abort_upload`` twice is no error."""
    if not isinstance(store, MultipartStore):
        return
    key = f"{_ROOT}/multi.bin"
    size = max(store.limits.min_part_size, 4096)
    data = payload(2 * size + 100, seed=13)
    upload_id = store.start_upload(key)
    if not isinstance(upload_id, str) or not upload_id:
        _fail(store, "start_upload", "return the upload's id (a non-empty str)",
              f"start_upload({key!r}) returned {upload_id!r}")
    chunks = {1: data[:size], 2: data[size:2 * size], 3: data[2 * size:]}
    tags: dict[int, str] = {}
    for number in (2, 3, 1):  # parts go up concurrently, in any order
        buf = bytearray(chunks[number])
        tags[number] = store.upload_part(key, upload_id, number, memoryview(buf))
        buf[:] = bytes(len(buf))  # a pooled buffer, reused at once
    store.complete_upload(key, upload_id, [(n, tags[n]) for n in (1, 2, 3)])
    got = store.read(key)
    if got is None or bytes(got) != data:
        _fail(store, "complete_upload", "assemble the parts in order of their numbers "
              "(upload_part stores a copy of each)", f"{key!r} reads "
              f"{0 if got is None else len(got)} bytes, differing from the parts'")
    other = f"{_ROOT}/aborted.bin"
    upload_id = store.start_upload(other)
    store.upload_part(other, upload_id, 1, memoryview(b"x" * size))
    for attempt in ("", " (twice)"):
        try:
            store.abort_upload(other, upload_id)
        except Exception as exc:
            _fail(store, "abort_upload", "an upload already gone is not an error" + attempt,
                  f"raised {exc!r}")
    for entry in store.list_uploads(_ROOT):
        if not (isinstance(entry, tuple) and len(entry) == 2):
            _fail(store, "list_uploads", "yield (key, upload_id) pairs", f"gave {entry!r}")


def check_open_stream(store: ObjectStore) -> None:
    """``open_stream``: ``None`` or an :class:`Upload` whose commit stores the object."""
    key = f"{_ROOT}/stream.bin"
    upload = store.open_stream(key)
    if upload is None:
        return
    if not isinstance(upload, Upload):
        _fail(store, "open_stream", "return None or an Upload", f"returned {upload!r}")
    upload.write(b"streamed ")
    upload.write(memoryview(b"bytes"))
    upload.commit()
    if bytes(store.read(key) or b"") != b"streamed bytes":
        _fail(store, "open_stream", "the committed upload is the object", f"{key!r} reads "
              "differently")


def check_faults(store: ObjectStore, faults: dict[str, BaseException]) -> None:
    """``map_error`` of each SDK exception in ``faults`` (kind -> exception, see
    :data:`FAULT_KINDS`): the kind's class, retryable as the kind says."""
    for kind, exc in faults.items():
        if kind not in FAULT_KINDS:
            raise ValueError(f"store_faults: unknown kind {kind!r}; the kinds are "
                             f"{sorted(FAULT_KINDS)}")
        cls, retryable = FAULT_KINDS[kind]
        if not isinstance(exc, Exception):
            raise TypeError(f"store_faults[{kind!r}] must be an exception instance, got "
                            f"{exc!r}")
        mapped = store.map_error(exc, f"{_ROOT}/fault")
        if not isinstance(mapped, cls):
            _fail(store, "map_error", f"map the SDK's {kind} error to {cls.__name__}",
                  f"map_error({exc!r}) returned {mapped!r}")
        if bool(mapped.retryable) != retryable:
            _fail(store, "map_error", f"a {kind} error is {'' if retryable else 'not '}"
                  "retryable", f"map_error({exc!r}) returned {mapped!r} with retryable="
                  f"{mapped.retryable}")


#: The checks every plugin passes, by name (each takes the store, at an empty location).
CHECKS: dict[str, Callable[[ObjectStore], None]] = {
    "read": check_read,
    "put": check_put,
    "head": check_head,
    "missing_object": check_missing_object,
    "list": check_list,
    "delete": check_delete,
    "multipart": check_multipart,
    "open_stream": check_open_stream,
}


# -- the pytest classes --------------------------------------------------------------


class ContractTests(ConformanceBase):
    """The contract's rules, run on ``backend.store`` (plugins only), and the
    non-HTTP error mapping of the ``store_faults`` hook."""

    @pytest.fixture
    def store(self, backend: Backend) -> ObjectStore:
        if not isinstance(backend, StoreBackend):
            pytest.skip(f"{type(backend).__name__} is not a plugin (an old-style Backend "
                        "subclass): the contract checks run on an ObjectStore")
        return backend.store

    @pytest.mark.parametrize("check", sorted(CHECKS))
    def test_contract_rule(self, store: ObjectStore, check: str) -> None:
        CHECKS[check](store)

    def test_store_faults_mapped(self, store: ObjectStore,
                                 store_faults: dict[str, BaseException] | None) -> None:
        if not store_faults:
            pytest.skip("no store_faults hook: the SDK's throttling/timeout/denied "
                        "exceptions are not given")
        check_faults(store, store_faults)

    def _retryable_fault(self, faults: dict[str, BaseException] | None) -> Exception:
        for kind in _RETRYABLE:
            fault = (faults or {}).get(kind)
            if isinstance(fault, Exception):
                return fault
        pytest.skip("no retryable kind (throttled, unavailable, timeout) in store_faults")

    @pytest.fixture
    def faulty(self, checkpoint_uri: str, backend_options: dict[str, Any],
               store_faults: dict[str, BaseException] | None) -> Callable[..., Any]:
        """``faulty(attempts=N)``: see :meth:`_faulty`."""
        return functools.partial(self._faulty, checkpoint_uri, backend_options, store_faults)

    @contextlib.contextmanager
    def _faulty(self, checkpoint_uri: str, backend_options: dict[str, Any],
                store_faults: dict[str, BaseException] | None,
                attempts: int) -> Iterator[tuple[Exception, StoreBackend]]:
        """A retryable fault of ``store_faults``, and a plugin backend that tries each
        request ``attempts`` times and holds ``faulty.bin``; closed on exit."""
        fault = self._retryable_fault(store_faults)
        backend = dcpstore.open_backend(checkpoint_uri, **{**backend_options,
                                                           "max_attempts": attempts,
                                                           **_FAST_RETRY})
        try:
            if not isinstance(backend, StoreBackend):
                pytest.skip(f"{type(backend).__name__} is not a plugin")
            backend.put("faulty.bin", b"payload")
            yield fault, backend
        finally:
            backend.close()

    def test_fault_is_retried_then_succeeds(self, faulty: Callable[..., Any]) -> None:
        with faulty(attempts=4) as (fault, backend):
            calls = _inject(backend.store, "read", fault, times=2)
            assert backend.get("faulty.bin") == b"payload"
            assert len(calls) == 3, f"read was called {len(calls)} times, expected 3 " \
                f"(two {fault!r} retried)"
            calls = _inject(backend.store, "put", fault, times=1)
            backend.put("faulty2.bin", b"again")
            assert len(calls) == 2 and backend.get("faulty2.bin") == b"again"

    def test_fault_exhausted_is_its_kind(self, faulty: Callable[..., Any]) -> None:
        with faulty(attempts=2) as (fault, backend):
            expected = type(backend.store.map_error(fault, "faulty.bin"))
            calls = _inject(backend.store, "read", fault, times=None)
            with pytest.raises(errors.StoreError) as info:
                backend.get("faulty.bin")
            assert isinstance(info.value, expected), repr(info.value)
            assert info.value.retryable and len(calls) == 2
            assert isinstance(info.value.__cause__, type(fault))


def _inject(store: ObjectStore, method: str, fault: Exception,
            times: int | None) -> list[int]:
    """Make ``store.<method>`` raise ``fault`` its first ``times`` calls (``None``:
    always); return the list of calls made (its length counts them)."""
    real = getattr(store, method)
    calls: list[int] = []

    def faulty(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if times is None or len(calls) <= times:
            raise fault
        return real(*args, **kwargs)

    setattr(store, method, faulty)
    return calls
