"""A fault-injecting wrapper backend: commit-protocol tests without HTTP.

``FaultBackend(inner, faults=[...])`` forwards every primitive to ``inner`` and fails
the calls its :class:`Fault` s pick, in the spirit of httpx's ``MockTransport``::

    store = MemoryBackend("ckpt/run")
    faulty = FaultBackend(store, [Fault("put", key=".metadata", error="throttle", times=2)])
    writer = dcpstore.Writer(faulty)

The injected errors are what a store client raises after its own translation:
``"throttle"`` (a 503 SlowDown: retried, then
:class:`~dcpstore.errors.StoreThrottledError`), ``"timeout"`` and ``"connection"`` (a
reset) are retryable, so the base class retries them; ``"truncate"`` delivers part of a read and
then drops the connection; ``"crash"`` raises :class:`SimulatedCrash` (a
``BaseException``) and from then on every call does the same, as if the process had
died: no clean-up reaches the store. ``after=True`` lets the call reach ``inner`` first
and then fails its answer (a request that landed, with its response lost).

For code that opens backends from URIs (``dcpstore.save``), :meth:`FaultBackend.wrapping`
makes a class to pass to ``register_backend``.
"""

from __future__ import annotations

import errno
import fnmatch
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from typing_extensions import Buffer

from dcpstore.errors import StoreThrottledError
from dcpstore.storage.backend import Backend, BackendOptions, Failure, ObjectInfo, Upload
from dcpstore.storage.uri import ParsedURI

__all__ = [
    "OPS",
    "Fault",
    "FaultBackend",
    "FaultState",
    "InjectedConnectionError",
    "InjectedThrottling",
    "InjectedTimeout",
    "SimulatedCrash",
]

#: Primitives a :class:`Fault` can name (``write`` / ``commit`` / ``abort``: of uploads).
OPS = ("open_upload", "write", "commit", "abort", "read", "put", "get", "stat", "list",
       "delete", "list_uploads", "abort_upload", "remove_empty_dirs")


class InjectedThrottling(ConnectionError):
    """An injected ``503 SlowDown`` (retryable)."""


class InjectedTimeout(TimeoutError):
    """An injected request timeout (retryable)."""


class InjectedConnectionError(ConnectionResetError):
    """An injected dropped connection (retryable)."""


class SimulatedCrash(BaseException):
    """The process "died" here: raised by every later call of the same backend too."""


@dataclass
class Fault:
    """Which calls fail, and how.

    Attributes:
        op: The primitive (one of :data:`OPS`).
        nth: The first matching call that fails (1-based).
        times: How many matching calls fail from ``nth`` on (``0``: every one).
        error: ``"throttle"``, ``"timeout"``, ``"connection"``, ``"truncate"`` (reads
            only), ``"crash"``, or an exception instance to raise.
        key: Only calls on keys matching this ``fnmatch`` pattern count.
        after: Run the call on the inner backend first, then fail (the answer was lost).
    """

    op: str
    nth: int = 1
    times: int = 1
    error: str | BaseException = "connection"
    key: str | None = None
    after: bool = False
    seen: int = field(default=0, init=False)
    injected: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown op {self.op!r}; one of {', '.join(OPS)}")
        if self.nth < 1 or self.times < 0:
            raise ValueError(f"nth must be >= 1 and times >= 0, got {self.nth}, {self.times}")
        if self.error == "truncate" and self.op not in ("read", "get"):
            raise ValueError("error='truncate' applies to 'read' and 'get' only")

    def _fires(self, op: str, key: str | None) -> bool:
        if op != self.op or (self.key is not None and not fnmatch.fnmatchcase(key or "",
                                                                             self.key)):
            return False
        self.seen += 1
        if self.seen < self.nth or (self.times and self.seen >= self.nth + self.times):
            return False
        self.injected += 1
        return True


class FaultState:
    """Faults and counters shared by a wrapper, its children and (``wrapping``) every
    instance of a registered class.

    Attributes:
        faults: The faults in force (a live list).
        calls: Calls per primitive (retries included).
        crashed: Whether a ``"crash"`` fault fired.
    """

    def __init__(self, faults: Iterable[Fault]) -> None:
        self.faults = list(faults)
        self.calls: Counter[str] = Counter()
        self.crashed = False
        self.lock = threading.Lock()


class _FaultUpload(Upload):
    def __init__(self, owner: FaultBackend, inner: Upload, key: str) -> None:
        self.owner = owner
        self.inner = inner
        self.key = key

    def write(self, data: Buffer) -> int:
        return int(self.owner._run("write", self.key, lambda: self.inner.write(data)))

    def expect_size(self, nbytes: int) -> None:
        self.inner.expect_size(nbytes)

    def commit(self) -> ObjectInfo:
        info: ObjectInfo = self.owner._run("commit", self.key, self.inner.commit)
        return info

    def abort(self) -> None:
        self.owner._run("abort", self.key, self.inner.abort)


class FaultBackend(Backend):
    """Wraps ``inner`` and fails the calls ``faults`` pick (see the module docstring).

    Args:
        inner: The backend that stores (e.g. a :class:`~dcpstore.testing.MemoryBackend`).
        faults: The faults to inject; they may be changed later through :attr:`faults`.

    Attributes:
        calls: Calls per primitive that reached this wrapper (retries included).
    """

    name: ClassVar[str] = "faulty"
    #: The state every instance of a :meth:`wrapping` class shares (only set there).
    shared: ClassVar[FaultState]

    def __init__(self, inner: Backend, faults: Iterable[Fault] = (), *,
                 _state: FaultState | None = None) -> None:
        super().__init__(inner.location, inner.options)
        self.inner = inner
        self._state = _state if _state is not None else FaultState(faults)

    @classmethod
    def wrapping(cls, inner_cls: type[Backend], faults: Iterable[Fault]) -> type[FaultBackend]:
        """A class for ``register_backend`` whose every instance wraps an ``inner_cls``
        backend and shares ``faults`` and the counters (the class's ``shared``
        :class:`FaultState`)."""
        state = FaultState(faults)

        class Bound(FaultBackend):
            Options: ClassVar[type[BackendOptions]] = inner_cls.Options
            shared: ClassVar[FaultState] = state

            @classmethod
            def from_uri(cls, uri: ParsedURI, options: BackendOptions) -> Backend:
                return cls(inner_cls(uri.location, options), _state=state)

        Bound.__name__ = Bound.__qualname__ = f"Faulty{inner_cls.__name__}"
        return Bound

    # -- what tests look at --------------------------------------------------------------

    @property
    def faults(self) -> list[Fault]:
        """The faults in force (a live list: append or clear it)."""
        return self._state.faults

    @property
    def calls(self) -> Counter[str]:
        return self._state.calls

    @property
    def crashed(self) -> bool:
        """Whether a ``"crash"`` fault fired."""
        return self._state.crashed

    uri = property(lambda self: self.inner.uri, doc="The wrapped backend's URI.")

    def child(self, key: str) -> Backend:
        return FaultBackend(self.inner.child(key), _state=self._state)

    def at(self, location: str) -> Backend:
        return FaultBackend(self.inner.at(location), _state=self._state)

    def close(self) -> None:
        super().close()
        self.inner.close()

    # -- injection -----------------------------------------------------------------------

    def _pick(self, op: str, key: str | None) -> Fault | None:
        with self._state.lock:
            if self._state.crashed:
                raise SimulatedCrash(f"{op} {key}: this process crashed earlier")
            self._state.calls[op] += 1
            for fault in self._state.faults:
                if fault._fires(op, key):
                    return fault
        return None

    def _raise(self, fault: Fault, op: str, key: str | None) -> None:
        what = f"{op} {key!r}" if key else op
        error = fault.error
        if isinstance(error, BaseException):
            raise error
        if error == "crash":
            with self._state.lock:
                self._state.crashed = True
            raise SimulatedCrash(f"crash injected at {what}")
        if error == "throttle":
            raise InjectedThrottling(f"503 SlowDown (injected) at {what}: reduce your "
                                     "request rate")
        if error == "timeout":
            raise InjectedTimeout(f"request timed out (injected) at {what}")
        raise InjectedConnectionError(f"connection reset (injected) at {what}")

    def _run(self, op: str, key: str | None, call: Callable[[], Any]) -> Any:
        fault = self._pick(op, key)
        if fault is None or fault.error == "truncate":
            return call()
        if fault.after:
            call()
        self._raise(fault, op, key)
        raise AssertionError("unreachable")  # pragma: no cover

    # -- primitives ----------------------------------------------------------------------

    def _open_upload(self, key: str) -> Upload:
        inner: Upload = self._run("open_upload", key, lambda: self.inner._open_upload(key))
        return _FaultUpload(self, inner, key)

    def _read_into(self, key: str, offset: int, outs: Sequence[memoryview]) -> None:
        fault = self._pick("read", key)
        if fault is not None and fault.error == "truncate":
            total = sum(len(o) for o in outs)
            if outs and len(outs[0]) > 1:  # part of the bytes arrive, then the cut
                self.inner._read_into(key, offset, [outs[0][: len(outs[0]) // 2]])
            raise InjectedConnectionError(f"connection closed before all {total} bytes of "
                                          f"{key!r} arrived (injected truncation)")
        if fault is not None and not fault.after:
            self._raise(fault, "read", key)
        self.inner._read_into(key, offset, outs)
        if fault is not None:
            self._raise(fault, "read", key)

    @property
    def conditional_writes(self) -> bool:
        return self.inner.conditional_writes

    def _put(self, key: str, data: bytes, *, atomic: bool, **conditions: Any) -> None:
        self._run("put", key, lambda: self.inner._put(key, data, atomic=atomic, **conditions))

    def _get(self, key: str) -> bytes:
        fault = self._pick("get", key)
        if fault is not None and fault.error == "truncate":
            data = self.inner._get(key)
            raise InjectedConnectionError(f"connection closed after {len(data) // 2} of "
                                          f"{len(data)} bytes of {key!r} (injected truncation)")
        if fault is None:
            return self.inner._get(key)
        if fault.after:
            self.inner._get(key)
        self._raise(fault, "get", key)
        raise AssertionError("unreachable")  # pragma: no cover

    def _stat(self, key: str) -> ObjectInfo:
        info: ObjectInfo = self._run("stat", key, lambda: self.inner._stat(key))
        return info

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        items: list[ObjectInfo] = self._run("list", prefix or None,
                                            lambda: list(self.inner._list(prefix)))
        return iter(items)

    def _delete(self, keys: Sequence[str]) -> None:
        self._run("delete", keys[0] if keys else None, lambda: self.inner._delete(keys))

    def _list_uploads(self, prefix: str) -> Iterable[tuple[str, str]]:
        uploads: list[tuple[str, str]] = self._run(
            "list_uploads", prefix or None, lambda: list(self.inner._list_uploads(prefix)))
        return uploads

    def _abort_upload(self, key: str, upload_id: str) -> None:
        self._run("abort_upload", key, lambda: self.inner._abort_upload(key, upload_id))

    def remove_empty_dirs(self) -> None:
        self._run("remove_empty_dirs", None, self.inner.remove_empty_dirs)

    def _classify(self, exc: Exception, key: str | None) -> Failure | None:
        if isinstance(exc, InjectedThrottling):  # as a store client's SlowDown is
            return Failure(StoreThrottledError(errno.EAGAIN, str(exc)), retryable=True)
        if isinstance(exc, (InjectedTimeout, InjectedConnectionError)):
            return None  # the default: retried, then raised as it is
        return self.inner._classify(exc, key)
