"""CRC32C: of a buffer, of consecutive buffers, per fixed-size block, and combined.

The hardware CRC itself is the ``crc32c`` package's. What it lacks is *combining*:
``crc32c_combine(crc(A), crc(B), len(B)) == crc(A + B)``. With it the writer makes one
pass over every byte and still gets three checksums from it: a CRC per block of a
tensor's payload (so a reshard load can verify just the blocks it reads), the item's
CRC and the data file's CRC.

Combining multiplies ``crc(A)`` by ``x^(8 len(B))`` modulo the Castagnoli polynomial
(bit-reflected, as in zlib's ``crc32_combine``); the power is built from a table of
``x^(2^k)``, so a combine costs a few dozen carry-less multiplications in Python,
independent of the lengths.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import crc32c as _crc32c
from typing_extensions import Buffer

__all__ = ["BlockCRCs", "block_crcs", "crc32c", "crc32c_combine"]

_POLY = 0x82F63B78  # Castagnoli, bit-reflected
_ONE = 1 << 31  # the polynomial "1" in reflected order


def crc32c(data: Buffer, value: int = 0) -> int:
    """CRC32C of ``data``, continuing from ``value`` (the CRC of the bytes before it)."""
    return int(_crc32c.crc32c(data, value))


def _multiply(a: int, b: int) -> int:
    """``a * b`` modulo the polynomial (both reflected)."""
    product = 0
    mask = _ONE
    while mask:
        if a & mask:
            product ^= b
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
        mask >>= 1
    return product


def _powers() -> list[int]:
    table = [_ONE >> 1]  # x^1
    for _ in range(63):
        table.append(_multiply(table[-1], table[-1]))
    return table


_X_POW_2K = _powers()  # x^(2^k), k = 0..63


@functools.lru_cache(maxsize=256)
def _shift(nbytes: int) -> int:
    """``x^(8 nbytes)`` modulo the polynomial."""
    result = _ONE
    bits = nbytes * 8
    k = 0
    while bits:
        if bits & 1:
            result = _multiply(_X_POW_2K[k], result)
        bits >>= 1
        k += 1
    return result


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """The CRC32C of ``A + B`` from ``crc32c(A)``, ``crc32c(B)`` and ``len(B)``."""
    if len_b <= 0:
        return crc_a
    return _multiply(_shift(len_b), crc_a) ^ crc_b


class BlockCRCs:
    """CRC32C of every ``block`` bytes of a byte stream fed in pieces of any size (the
    last block may be shorter)."""

    def __init__(self, block: int) -> None:
        self.block = block
        self._crcs: list[int] = []
        self._value = self._filled = 0

    def feed(self, piece: Buffer) -> None:
        view = memoryview(piece).cast("B")
        pos, size = 0, len(view)
        while pos < size:
            take = min(self.block - self._filled, size - pos)
            self._value = crc32c(view[pos : pos + take], self._value)
            self._filled += take
            pos += take
            if self._filled == self.block:
                self._crcs.append(self._value)
                self._value = self._filled = 0

    def result(self) -> list[int]:
        """The CRCs of the blocks fed so far, the unfinished one included."""
        return self._crcs + ([self._value] if self._filled else [])


def block_crcs(pieces: Sequence[memoryview], block: int) -> list[int]:
    """CRC32C of every ``block`` bytes of the concatenation of ``pieces`` (the last block
    may be shorter), without joining them."""
    crcs = BlockCRCs(block)
    for piece in pieces:
        crcs.feed(piece)
    return crcs.result()
