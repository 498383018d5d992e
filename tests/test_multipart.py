"""The generic multipart upload of ``dcpstore.storage.multipart``: pooled part buffers, upload
slots, aborts and failures, against an in-memory fake backend (no server)."""

from __future__ import annotations

import pickle
import secrets
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from dcpstore.storage.backend import Backend, BackendOptions, ObjectInfo, Upload
from dcpstore.storage.multipart import (
    MultipartState,
    MultipartUpload,
    PartBuffers,
    first_buffer_bytes,
)


class _MemoryMultipart(MultipartUpload):
    """Parts kept in memory; ``fail_part`` / ``gate`` script a part's request."""

    backend: _MemoryBackend

    def _create(self) -> str:
        self.backend.creates += 1
        return f"up{self.backend.creates}"

    def _upload_part(self, upload_id: str, number: int, data: memoryview) -> Any:
        be = self.backend
        be.part_objects.append(data.obj)
        if be.gate is not None:
            be.gate.wait()
        if number == be.fail_part:
            raise OSError(f"part {number} refused")
        be.parts.setdefault(upload_id, {})[number] = bytes(data)
        return number

    def _complete(self, upload_id: str, parts: list[tuple[int, Any]]) -> None:
        chunks = self.backend.parts.pop(upload_id)
        assert [n for n, _ in parts] == sorted(chunks)
        self.backend.objects[self.key] = b"".join(chunks[n] for n, _ in parts)

    def _abort_multipart(self, upload_id: str) -> None:
        self.backend.aborted.append(upload_id)
        self.backend.parts.pop(upload_id, None)

    def _put_whole(self, data: memoryview) -> None:
        assert len(data) < self.first_buffer()
        self.backend.whole_puts.append(len(data))
        self.backend.objects[self.key] = bytes(data)


class _MemoryBackend(Backend):
    name = "memory-multipart"

    def __init__(self, location: str = "mem", options: BackendOptions | None = None) -> None:
        super().__init__(location, options)
        self.objects: dict[str, bytes] = {}
        self.parts: dict[str, dict[int, bytes]] = {}
        self.part_objects: list[Any] = []
        self.aborted: list[str] = []
        self.creates = 0
        self.whole_puts: list[int] = []
        self.fail_part: int | None = None
        self.gate: threading.Event | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(gate=None, part_objects=[])
        return state

    def _open_upload(self, key: str) -> Upload:
        return _MemoryMultipart(self, key)

    def _read_into(self, key: str, offset: int, outs: Sequence[memoryview]) -> None:
        raise NotImplementedError

    def _put(self, key: str, data: bytes, *, atomic: bool) -> None:
        self.objects[key] = data

    def _get(self, key: str) -> bytes:
        return self.objects[key]

    def _stat(self, key: str) -> ObjectInfo:
        return ObjectInfo(key, len(self.objects[key]))

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        return iter(())

    def _delete(self, keys: Sequence[str]) -> None:
        pass


def _memory_backend(part: int = 1000, concurrency: int = 3) -> _MemoryBackend:
    return _MemoryBackend(options=BackendOptions(part_size=part, max_concurrency=concurrency,
                                                 max_attempts=1))


def _pool(backend: Backend, part: int = 1000) -> PartBuffers:
    return PartBuffers.of(backend, part, _MemoryMultipart._allocate_buffer)


def _odd_writes(upload: Upload, data: bytes) -> None:
    sizes = [1, 999, 1001, 7, 2500, 333, 1000, 0, 4093]
    pos = i = 0
    while pos < len(data):
        n = sizes[i % len(sizes)]
        upload.write(data[pos:pos + n])
        pos += n
        i += 1


def test_multipart_reuses_part_buffers_and_keeps_bytes_in_order() -> None:
    backend = _memory_backend()
    data = secrets.token_bytes(200 * 1000 + 123)  # 201 parts, the last one short
    upload = backend.open_upload("big")
    _odd_writes(upload, data)
    assert upload.commit() == ObjectInfo("big", len(data))
    assert backend.objects["big"] == data
    pool = _pool(backend)
    # 3 parts in flight + the one being filled, however many parts went up
    assert 0 < pool.allocated <= 3 + 1
    assert len({id(o) for o in backend.part_objects}) <= pool.allocated
    assert pool.outstanding == 0 and pool.free == pool.allocated
    # a second upload of the same backend reuses them: nothing new is allocated
    upload = backend.open_upload("again")
    _odd_writes(upload, data[:5000])
    upload.commit()
    assert backend.objects["again"] == data[:5000] and pool.allocated <= 4


class _GrowingMultipart(_MemoryMultipart):
    part_growth = ((3, 2), (6, 4))


def test_multipart_part_size_grows_every_step_up_to_its_cap(monkeypatch: Any) -> None:
    backend = _memory_backend()
    monkeypatch.setattr(backend, "_open_upload", lambda key: _GrowingMultipart(backend, key))
    data = secrets.token_bytes(3 * 1000 + 3 * 2000 + 5 * 4000 + 10)
    upload = backend.open_upload("grown")
    _odd_writes(upload, data)
    upload.commit()
    assert backend.objects["grown"] == data
    sizes = [len(o) for o in backend.part_objects]
    # 3 parts of part_size, 3 of twice it, then 4x (the cap), the last one short
    assert sizes == [1000] * 3 + [2000] * 3 + [4000] * 6
    assert [upload.part_bytes(n) for n in (1, 3, 4, 7, 100)] == [1000, 1000, 2000, 4000, 4000]


def test_s3_largest_object_is_what_the_part_growth_admits() -> None:
    from dcpstore_s3.options import largest_object

    mib = 1 << 20
    assert largest_object(8 * mib) == 8 * mib * (1000 + 2 * 1000 + 4 * 8000)
    assert largest_object(8 * mib) > 256 * (1 << 30)  # the fixed 8 MiB allowed 78 GiB


def test_multipart_concurrent_uploads_share_the_pool() -> None:
    backend = _memory_backend()
    datas = [secrets.token_bytes(50 * 1000 + i) for i in range(4)]
    errors: list[BaseException] = []

    def save(i: int) -> None:
        try:
            with backend.open_upload(f"f{i}") as upload:
                _odd_writes(upload, datas[i])
                upload.commit()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=save, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(backend.objects[f"f{i}"] == datas[i] for i in range(4))
    pool = _pool(backend)
    assert pool.peak <= 3 + 4  # in flight + one being filled per open upload
    assert pool.outstanding == 0 and pool.free == min(pool.allocated, 3 + 2)


def test_multipart_small_and_empty_objects_are_one_request() -> None:
    backend = _memory_backend()
    for key, payload in [("small", b"x" * 999), ("empty", b"")]:
        upload = backend.open_upload(key)
        upload.write(payload)
        assert upload.commit().size == len(payload)
        assert backend.objects[key] == payload
    assert backend.creates == 0
    assert _pool(backend).outstanding == 0
    # exactly one part: a multipart upload of one full part, nothing left to put
    upload = backend.open_upload("one")
    upload.write(b"y" * 1000)
    upload.commit()
    assert backend.objects["one"] == b"y" * 1000 and backend.creates == 1


def test_multipart_announced_object_is_one_request_in_a_buffer_of_its_own(
        monkeypatch: Any) -> None:
    backend = _memory_backend()
    # announced objects up to 5 parts' bytes are sent in one request
    monkeypatch.setattr(backend, "upload_memory",
                        lambda hint=None: first_buffer_bytes(1000, 5000, hint))
    mib = 1 << 20
    assert first_buffer_bytes(1000, 5000, 4321) == mib  # a whole MiB at least
    assert first_buffer_bytes(8 * mib, 64 * mib, 19 * mib + 5) == 20 * mib
    assert [first_buffer_bytes(8 * mib, 64 * mib, n) for n in (None, mib, 65 * mib)] == [
        8 * mib] * 3
    pool = _pool(backend)
    data = secrets.token_bytes(4321)
    upload = backend.open_upload("whole", size_hint=len(data))
    _odd_writes(upload, data)
    upload.commit()
    assert backend.objects["whole"] == data
    assert backend.whole_puts == [len(data)] and backend.creates == 0
    assert pool.allocated == 0  # not a part buffer: one of its own size, kept for reuse
    whole = MultipartState.of(backend).whole_buffers(mib, _MemoryMultipart._allocate_buffer)
    assert whole.allocated == 1 and whole.free == 1

    # an announcement that falls short: the filled buffer becomes part 1
    data = secrets.token_bytes(5000)
    upload = backend.open_upload("short", size_hint=len(data))
    monkeypatch.setattr(upload, "first_buffer", lambda: 3000)
    _odd_writes(upload, data)
    upload.commit()
    assert backend.objects["short"] == data and backend.creates == 1
    assert [len(o) for o in backend.part_objects] == [3000, 1000, 1000]

    # over the limit, or unannounced: parts as always
    for key, hint in (("over", 6000), ("plain", None)):
        backend.part_objects.clear()
        upload = backend.open_upload(key, size_hint=hint)
        _odd_writes(upload, data)
        upload.commit()
        assert backend.objects[key] == data
        assert [len(o) for o in backend.part_objects] == [1000] * 5
    assert backend.whole_puts == [4321]


def test_whole_object_buffers_stay_within_the_window() -> None:
    mib = 1 << 20
    state = MultipartState.of(_memory_backend(part=mib, concurrency=4))  # 4 MiB
    three = state.whole_buffers(3 * mib)
    three.release(three.acquire())
    assert three.held == 3 * mib
    # another size: room is made by dropping the idle 3 MiB buffer
    two = state.whole_buffers(2 * mib)
    assert three.held == 0 and three.free == 0
    held = [two.acquire(), two.acquire()]
    # in use is never dropped; the same size is reused
    assert state.whole_buffers(3 * mib) is three and two.held == 4 * mib
    for buf in held:
        two.release(buf)
    assert two.free == 2 and state.whole_buffers(2 * mib).acquire() in held


def test_multipart_abort_releases_every_buffer_and_slot() -> None:
    backend = _memory_backend(concurrency=2)
    backend.gate = threading.Event()
    upload = backend.open_upload("aborted")
    upload.write(bytes(2 * 1000 + 10))  # two parts in flight (stuck), a third filling
    pool = _pool(backend)
    assert pool.outstanding == 3
    threading.Timer(0.2, backend.gate.set).start()
    upload.abort()  # waits for the parts in flight, then aborts the upload
    assert backend.aborted == ["up1"] and "aborted" not in backend.objects
    assert pool.outstanding == 0 and pool.free == 3
    assert MultipartState.of(backend).slots.in_flight == 0
    upload.abort()  # twice is fine
    assert pool.outstanding == 0


def test_multipart_parts_cancelled_before_they_ran_give_their_buffers_back() -> None:
    backend = _memory_backend(concurrency=2)
    release = threading.Event()
    busy = [backend._executor().submit(release.wait) for _ in range(2)]  # e.g. reads
    upload = backend.open_upload("queued")
    upload.write(bytes(2 * 1000))  # two parts queued behind the busy workers
    pool = _pool(backend)
    assert pool.outstanding == 2
    upload.abort()
    release.set()
    for fut in busy:
        fut.result()
    assert backend.part_objects == []  # never ran
    assert pool.outstanding == 0 and pool.free == 2
    assert MultipartState.of(backend).slots.in_flight == 0
    upload = backend.open_upload("after")  # the slots are all there: no deadlock
    upload.write(bytes(5 * 1000 + 1))
    upload.commit()
    assert backend.objects["after"] == bytes(5 * 1000 + 1)


def test_multipart_failed_part_releases_its_buffer_and_surfaces() -> None:
    import concurrent.futures

    backend = _memory_backend()
    backend.fail_part = 3
    upload = backend.open_upload("failing")
    upload.write(bytes(3 * 1000))
    assert isinstance(upload, MultipartUpload)
    concurrent.futures.wait(upload._futures)
    with pytest.raises(OSError, match="part 3 refused"):
        upload.write(b"more")
    with pytest.raises(OSError, match="part 3 refused"):
        upload.commit()  # aborts
    pool = _pool(backend)
    assert backend.aborted == ["up1"] and pool.outstanding == 0
    assert pool.free == pool.allocated

    backend.fail_part = 2  # the short last part fails: commit raises it
    upload = backend.open_upload("failing-tail")
    upload.write(bytes(1500))
    with pytest.raises(OSError, match="part 2 refused"):
        upload.commit()
    assert backend.aborted == ["up1", "up2"] and "failing-tail" not in backend.objects
    assert pool.outstanding == 0


def test_part_buffer_pool_bounds_idle_buffers() -> None:
    pool = PartBuffers(64, keep=2)
    bufs = [pool.acquire() for _ in range(5)]
    assert pool.allocated == 5 and pool.outstanding == 5
    assert all(len(memoryview(b)) == 64 for b in bufs)
    for b in bufs:
        pool.release(b)
    assert pool.free == 2 and pool.outstanding == 0  # the other three were dropped
    again = pool.acquire()
    assert any(again is b for b in bufs) and pool.allocated == 5
    pool.release(again)
    with pytest.raises(RuntimeError, match="twice"):
        pool.release(again)


def test_backend_close_drops_part_buffers_and_stays_picklable() -> None:
    backend = _memory_backend()
    upload = backend.open_upload("a")
    upload.write(bytes(4500))
    upload.commit()
    old = _pool(backend)
    assert old.free > 0
    pickle.loads(pickle.dumps(backend))  # the pool (anonymous maps) is not pickled
    backend.close()
    assert MultipartState.peek(backend) is None
    upload = backend.open_upload("b")  # still usable: a fresh pool
    upload.write(bytes(2500))
    upload.commit()
    assert backend.objects["b"] == bytes(2500)
    assert _pool(backend) is not old and _pool(backend).outstanding == 0
    clone = pickle.loads(pickle.dumps(backend))
    assert MultipartState.peek(clone) is None
