"""HTTP/1.1 on a socket, as the fault proxy reads it: message heads, bodies streamed
(``Content-Length``, chunked or until EOF) with a peek buffer, and the exceptions that
end a connection."""

from __future__ import annotations

import contextlib
import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass

__all__: list[str] = []

_CHUNK = 256 * 1024
_MAX_HEAD = 64 * 1024


class _Closed(Exception):
    """The peer closed the connection in the middle of a message."""


class _BadMessage(Exception):
    """Not a well-formed HTTP/1.x message."""


class _Reader:
    """Buffered reads from a socket (head lines, bounded body reads)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def _fill(self) -> bool:
        data = self.sock.recv(_CHUNK)
        if not data:
            return False
        self.buf += data
        return True

    def read_head(self) -> bytes | None:
        """One message head (through the blank line); ``None`` at a clean EOF."""
        return self._read_through(b"\r\n\r\n", "message head too large",
                                  "connection closed inside a message head", eof_ok=True)

    def readline(self) -> bytes:
        line = self._read_through(b"\r\n", "line too long",
                                  "connection closed inside a line", eof_ok=False)
        assert line is not None
        return line

    def _read_through(self, end_mark: bytes, too_long: str, closed: str, *,
                      eof_ok: bool) -> bytes | None:
        """The bytes up to and including ``end_mark``; ``None`` at a clean EOF before
        any byte where ``eof_ok`` (a message head, before which stray CRLFs are
        dropped)."""
        while True:
            while eof_ok and self.buf[:2] == b"\r\n":  # allowed between messages
                del self.buf[:2]
            end = self.buf.find(end_mark)
            if end >= 0:
                data = bytes(self.buf[: end + len(end_mark)])
                del self.buf[: end + len(end_mark)]
                return data
            if len(self.buf) > _MAX_HEAD:
                raise _BadMessage(too_long)
            if not self._fill():
                if self.buf or not eof_ok:
                    raise _Closed(closed)
                return None

    def read_some(self, limit: int) -> bytes:
        """Up to ``limit`` (> 0) bytes; ``b""`` only at EOF."""
        if self.buf:
            data = bytes(self.buf[:limit])
            del self.buf[:limit]
            return data
        return self.sock.recv(min(limit, _CHUNK))


@dataclass
class _Message:
    """A parsed request or response head."""

    start: str  # request line or status line
    headers: list[tuple[str, str]]
    raw: bytes

    def get(self, name: str) -> str | None:
        name = name.lower()
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    def tokens(self, name: str) -> set[str]:
        name = name.lower()
        return {t.strip().lower() for k, v in self.headers if k.lower() == name
                for t in v.split(",")}

    def wants_close(self) -> bool:
        words = self.start.split(" ")
        version = words[0] if self.start.startswith("HTTP/") else words[-1]
        conn = self.tokens("connection")
        if "close" in conn:
            return True
        return version.endswith("/1.0") and "keep-alive" not in conn


def _parse_head(raw: bytes) -> _Message:
    try:
        text = raw.decode("latin-1")
    except UnicodeDecodeError as exc:  # pragma: no cover - latin-1 decodes anything
        raise _BadMessage(str(exc)) from exc
    lines = text.split("\r\n")
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise _BadMessage(f"malformed header line {line!r}")
        headers.append((name.strip(), value.strip()))
    return _Message(lines[0], headers, raw)


class _Body:
    """Payload of one message, read incrementally (``Content-Length``, chunked or
    until EOF), with a peek buffer."""

    def __init__(self, reader: _Reader, *, length: int | None = None, chunked: bool = False,
                 until_eof: bool = False) -> None:
        self.reader = reader
        self.chunked = chunked
        self.until_eof = until_eof
        self.remaining = length or 0
        self.length = length
        self.done = not chunked and not until_eof and not length
        self.total = 0
        self.counted = 0  # of total, what is in the proxy's stats already
        self._chunk_left = 0
        self._pending = bytearray()

    @classmethod
    def of(cls, reader: _Reader, msg: _Message, *, request: bool, no_body: bool = False
           ) -> _Body:
        if no_body:
            return cls(reader)
        if "chunked" in msg.tokens("transfer-encoding"):
            return cls(reader, chunked=True)
        length = msg.get("content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError as exc:
                raise _BadMessage(f"bad Content-Length {length!r}") from exc
            return cls(reader, length=n)
        return cls(reader) if request else cls(reader, until_eof=True)

    def _read_raw(self, limit: int) -> bytes:
        if self.done:
            return b""
        if self.chunked:
            if self._chunk_left == 0:
                line = self.reader.readline()
                size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.reader.readline() != b"\r\n":  # trailers
                        pass
                    self.done = True
                    return b""
                self._chunk_left = size
            data = self.reader.read_some(min(limit, self._chunk_left))
            if not data:
                raise _Closed("connection closed inside a chunked body")
            self._chunk_left -= len(data)
            if self._chunk_left == 0 and self.reader.readline() != b"\r\n":
                raise _BadMessage("chunk not followed by CRLF")
            return data
        if self.until_eof:
            data = self.reader.read_some(limit)
            if not data:
                self.done = True
            return data
        data = self.reader.read_some(min(limit, self.remaining))
        if not data:
            raise _Closed(f"connection closed with {self.remaining} body bytes missing")
        self.remaining -= len(data)
        if self.remaining == 0:
            self.done = True
        return data

    def read(self, limit: int = _CHUNK) -> bytes:
        """Up to ``limit`` payload bytes; ``b""`` at the end of the body."""
        if self._pending:
            data = bytes(self._pending[:limit])
            del self._pending[:limit]
            return data
        data = self._read_raw(limit)
        self.total += len(data)
        return data

    def peek(self, n: int) -> bytes:
        """The next (up to) ``n`` payload bytes, without consuming them."""
        while len(self._pending) < n and not self.done:
            data = self._read_raw(n - len(self._pending))
            self.total += len(data)
            self._pending += data
        return bytes(self._pending[:n])

    def drain(self) -> None:
        while self.read():
            pass

    def __iter__(self) -> Iterator[bytes]:
        while True:
            data = self.read()
            if not data:
                return
            yield data


class _Abort(Exception):
    """Close the client connection now (a fault or a broken peer)."""

    def __init__(self, reset: bool = False) -> None:
        super().__init__("abort")
        self.reset = reset


def _send_reset(sock: socket.socket) -> None:
    """Close ``sock`` with an RST instead of a FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()
