"""How one tensor item is encoded in a data file, and decoded without extra copies.

Items are ``torch.save`` archives, exactly as torch's ``FileSystemWriter`` writes them,
so torch's readers load dcpstore checkpoints. Two things differ from calling
``torch.save`` / ``torch.load`` naively:

- **Save** skips the archive's own CRC32 (``torch.load`` accepts archives without it):
  dcpstore's manifest already keeps a CRC32C of every item, computed while streaming,
  and a second checksum pass over every byte costs CPU that object-store uploads need.
- **Load** decodes an item that is already in memory (a fetched byte range) without
  copying its payload: the zip directory and the small ``data.pkl`` record are parsed,
  the pickle is run by torch's ``weights_only`` unpickler, and the storage it asks for
  is a view of the fetched bytes. ``torch.load`` on a buffer would copy the payload
  once more into a fresh storage.
- **Once per layout.** Without the archive CRC, an item's bytes outside its payload
  (zip headers, ``data.pkl``, directory) depend only on the tensor's dtype, shape and
  strides. So after one item is decoded, the next whose non-payload bytes are
  byte-identical is the same archive around other payload bytes: its tensor is built
  from the remembered dtype, shape and strides over its own payload, without parsing
  the zip or running the unpickler again (:class:`_Layouts`). A model's many
  same-shaped layers pay for one decode each.

Both fall back to ``torch.save`` / ``torch.load`` where the fast path does not apply
(an archive torch did not write this way, byte order different from the machine's).
"""

from __future__ import annotations

import bisect
import contextlib
import io
import itertools
import logging
import pickle
import struct
import sys
import threading
import zipfile
from collections.abc import Sequence
from typing import Any

import torch

from dcpstore import torch_internals

__all__ = ["ViewFile", "decode_tensor", "encode_tensor"]

logger = logging.getLogger(__name__)

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_LOCAL_MAGIC = b"PK\x03\x04"


def _probe_fast_save() -> bool:
    """Whether torch's archive writer can be driven directly (private API)."""
    try:
        buf = io.BytesIO()
        _save_without_crc(torch.arange(4, dtype=torch.float32), buf)
        buf.seek(0)
        return bool(torch.equal(torch.load(buf, weights_only=True),
                                torch.arange(4, dtype=torch.float32)))
    except Exception as exc:  # a torch release that changed the private API
        logger.debug("torch.save without CRC32 unavailable (%s); using torch.save", exc)
        return False


def _save_without_crc(tensor: torch.Tensor, stream: Any) -> None:
    writer = torch_internals.tensor_archive_writer(stream)
    try:
        torch_internals.write_tensor_archive(tensor, writer)
    except BaseException:
        # Finalize here, where a failure is only an exception: left unfinalized, the
        # writer's destructor finalizes it, and a failing stream (a store error) then
        # throws from a C++ destructor, which aborts the whole process.
        with contextlib.suppress(Exception):  # the stream is broken: keep the first error
            writer.write_end_of_file()
        raise
    writer.write_end_of_file()


_FAST_SAVE: bool | None = None


def encode_tensor(tensor: torch.Tensor, stream: Any) -> None:
    """Write ``tensor`` to ``stream`` as a ``torch.save`` archive.

    Args:
        tensor: A CPU tensor whose storage holds exactly its elements.
        stream: A file-like object with ``write``.
    """
    global _FAST_SAVE
    if _FAST_SAVE is None:
        _FAST_SAVE = _probe_fast_save()
    if _FAST_SAVE:
        _save_without_crc(tensor, stream)
    else:
        torch.save(tensor, stream)


class _Pieces:
    """Consecutive buffers seen as one byte string (an item fetched by a scatter read:
    head, tensor payload in its destination, tail)."""

    def __init__(self, pieces: Sequence[memoryview]) -> None:
        self.pieces = [p.cast("B") for p in pieces]
        self.starts = list(itertools.accumulate((len(p) for p in self.pieces), initial=0))

    def __len__(self) -> int:
        return self.starts[-1]

    def slice(self, start: int, stop: int) -> memoryview:
        """Bytes ``[start, stop)``: a view when they lie in one piece, else a copy."""
        start, stop = max(0, start), min(stop, len(self))
        if start >= stop:
            return memoryview(b"")
        i = bisect.bisect_right(self.starts, start) - 1
        base = self.starts[i]
        if stop <= base + len(self.pieces[i]):
            return self.pieces[i][start - base : stop - base]
        out = bytearray()
        while start < stop:
            i = bisect.bisect_right(self.starts, start) - 1
            base = self.starts[i]
            end = min(stop, base + len(self.pieces[i]))
            out += self.pieces[i][start - base : end - base]
            start = end
        return memoryview(out)


class ViewFile(io.RawIOBase):
    """A seekable, read-only file over a memoryview or consecutive memoryviews (no copy
    of the whole)."""

    def __init__(self, view: memoryview | Sequence[memoryview]) -> None:
        self._data = _Pieces([view] if isinstance(view, memoryview) else view)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        chunk = self._data.slice(self._pos, self._pos + len(out))
        out[: len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._data)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos


class _NotFast(Exception):
    """The archive is not one the zero-copy path handles; use ``torch.load``."""


class _Layout:
    """A decoded archive's non-payload bytes and what its tensor is over its payload."""

    __slots__ = ("dtype", "head", "offset", "size", "start", "stop", "stride", "tail")

    def __init__(self, view: _Pieces, start: int, stop: int, tensor: torch.Tensor) -> None:
        self.start, self.stop = start, stop
        self.head = bytes(view.slice(0, start))
        self.tail = bytes(view.slice(stop, len(view)))
        self.dtype, self.size, self.stride = tensor.dtype, tensor.size(), tensor.stride()
        self.offset = tensor.storage_offset()

    def matches(self, view: _Pieces) -> bool:
        return (bytes(view.slice(0, self.start)) == self.head
                and bytes(view.slice(self.stop, len(view))) == self.tail)

    def build(self, view: _Pieces) -> torch.Tensor:
        storage = torch.frombuffer(view.slice(self.start, self.stop), dtype=self.dtype)
        return storage.as_strided(self.size, self.stride, self.offset)


class _Layouts:
    """The archive layouts decoded so far, by item length (bounded; thread-safe). An
    item matches one when every byte outside the payload record is the same, so only
    archives without per-content fields qualify: dcpstore's (no CRC32; torch's writer
    records one per record, so its archives never match and are decoded in full)."""

    _MAX = 512

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_length: dict[int, list[_Layout]] = {}
        self._count = 0

    def find(self, view: _Pieces) -> _Layout | None:
        with self._lock:
            candidates = list(self._by_length.get(len(view), ()))
        return next((c for c in candidates if c.matches(view)), None)

    def remember(self, view: _Pieces, start: int, stop: int, tensor: torch.Tensor) -> None:
        # only a plain dense tensor over exactly this one record is rebuilt by a view
        if (type(tensor) is not torch.Tensor or tensor.requires_grad or tensor.is_conj()
                or tensor.is_neg() or tensor.layout != torch.strided or tensor.is_quantized
                or stop <= start
                or tensor.untyped_storage().nbytes() != stop - start):
            return
        layout = _Layout(view, start, stop, tensor)
        with self._lock:
            if self._count >= self._MAX:
                self._by_length.clear()
                self._count = 0
            self._by_length.setdefault(len(view), []).append(layout)
            self._count += 1


_LAYOUTS = _Layouts()


def decode_tensor(view: memoryview | Sequence[memoryview]) -> torch.Tensor:
    """Decode one ``torch.save``-d tensor, with ``weights_only`` safety.

    Args:
        view: The item's bytes: one buffer, or consecutive buffers (a scatter read).

    The tensor's storage is a view of the record's bytes where they lie in one writable
    buffer (copy the tensor out before the buffer is reused); otherwise the item is
    decoded by ``torch.load``.

    Raises:
        pickle.UnpicklingError: The archive holds something ``weights_only`` refuses.
        RuntimeError: The archive is damaged.
    """
    pieces = _Pieces([view] if isinstance(view, memoryview) else view)
    if not any(p.readonly for p in pieces.pieces):
        known = _LAYOUTS.find(pieces)
        if known is not None:
            return known.build(pieces)
        try:
            return _decode_in_place(pieces)
        except _NotFast as why:
            logger.debug("zero-copy decode not applicable (%s); using torch.load", why)
        except zipfile.BadZipFile as exc:
            raise RuntimeError(f"not a torch.save archive: {exc}") from exc
    source: Any = ViewFile(pieces.pieces)
    result = torch.load(source, map_location="cpu", weights_only=True)
    if not isinstance(result, torch.Tensor):
        raise pickle.UnpicklingError(f"expected a tensor, found {type(result).__name__}")
    return result


def _decode_in_place(view: _Pieces) -> torch.Tensor:
    # zipfile reads the central directory; records are sliced out of ``view`` by their
    # local headers (zipfile.read would insist on the CRC32 that we do not write).
    entries = {info.filename: info for info in zipfile.ZipFile(ViewFile(view.pieces)).infolist()}
    pickles = [name for name in entries if name.endswith("/data.pkl") and name.count("/") == 1]
    if len(pickles) != 1:
        raise _NotFast("no single <archive>/data.pkl record")
    root = pickles[0][: -len("data.pkl")]

    spans: list[tuple[int, int]] = []  # where the storage records lie
    last_span = [(0, 0)]

    def record(name: str, nbytes: int | None = None) -> memoryview:
        info = entries.get(root + name)
        if info is None:
            raise RuntimeError(f"archive has no record {name}")
        if info.compress_type != zipfile.ZIP_STORED:
            raise _NotFast(f"record {name} is compressed")
        if nbytes is not None and info.file_size != nbytes:
            raise RuntimeError(f"record {name} holds {info.file_size} bytes, expected {nbytes}")
        header = bytes(view.slice(info.header_offset, info.header_offset + _LOCAL_HEADER.size))
        if len(header) != _LOCAL_HEADER.size or header[:4] != _LOCAL_MAGIC:
            raise RuntimeError(f"record {name} has a damaged local header")
        fields = _LOCAL_HEADER.unpack(header)
        start = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
        if start + info.file_size > len(view):
            raise RuntimeError(f"record {name} runs past the end of the item")
        last_span[0] = (start, start + info.file_size)
        return view.slice(start, start + info.file_size)

    if root + "byteorder" in entries and bytes(record("byteorder")).decode() != sys.byteorder:
        raise _NotFast("byte order differs from this machine's")

    storages: dict[str, torch.storage.TypedStorage] = {}

    def persistent_load(saved_id: Any) -> torch.storage.TypedStorage:
        if not (isinstance(saved_id, tuple) and len(saved_id) == 5
                and saved_id[0] in ("storage", b"storage")):
            raise pickle.UnpicklingError(f"unexpected persistent id {saved_id!r}")
        storage_type, key, _location, numel = saved_id[1:]
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        key = key.decode() if isinstance(key, bytes) else str(key)
        if key not in storages:
            nbytes = int(numel) * torch_internals.element_size(dtype)
            if nbytes:
                untyped = torch.frombuffer(record(f"data/{key}", nbytes), dtype=torch.uint8)
                spans.append(last_span[0])
                untyped_storage = untyped.untyped_storage()
            else:
                untyped_storage = torch.UntypedStorage(0)
            storages[key] = torch.storage.TypedStorage(
                wrap_storage=untyped_storage, dtype=dtype, _internal=True
            )
        return storages[key]

    unpickler = torch_internals.restricted_unpickler(io.BytesIO(bytes(record("data.pkl"))))
    unpickler.persistent_load = persistent_load
    result = unpickler.load()
    if not isinstance(result, torch.Tensor):
        raise pickle.UnpicklingError(f"expected a tensor, found {type(result).__name__}")
    if len(spans) == 1:
        _LAYOUTS.remember(view, *spans[0], result)
    return result
