"""Checking a checkpoint's bytes: ``dcpstore verify``, and the reading it shares with copies.

:func:`verify_checkpoint` re-reads every data file (and the files of sibling steps an
incremental checkpoint references) and checks sizes and CRC32C against the manifest.
:func:`ordered_chunks` and :func:`reference_source` are how the tools read a
checkpoint's files, here and in :func:`~dcpstore.tools.maintenance.copy_checkpoint`.
Re-exported by :mod:`dcpstore.tools.ops`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from dcpstore.dcp import layout
from dcpstore.dcp.checksum import BlockCRCs, crc32c
from dcpstore.dcp.manifest import FileRecord
from dcpstore.dcp.metadata_io import (
    check_one_save,
    check_references,
    load_metadata,
    read_manifest,
)
from dcpstore.dcp.references import root_key, run_root
from dcpstore.errors import IntegrityError
from dcpstore.storage.backend import Backend, ReadRange
from dcpstore.storage.resolve import open_backend
from dcpstore.storage.uri import is_reference

__all__ = [
    "Progress",
    "VerifyReport",
    "no_progress",
    "ordered_chunks",
    "reference_source",
    "verify_checkpoint",
]

#: A callback receiving the byte counts a byte-moving operation moved.
Progress = Callable[[int], None]
_CHUNK = 8 * 1024 * 1024


def no_progress(_: int) -> None:
    """The default :data:`Progress` callback: ignores the counts."""


@dataclass
class VerifyReport:
    """What ``verify`` checked and what it found."""

    uri: str
    files: int = 0
    items: int = 0
    bytes: int = 0
    seconds: float = 0.0
    has_manifest: bool = True
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


def ordered_chunks(backend: Backend, key: str, start: int, length: int) -> Iterator[memoryview]:
    """The bytes of ``key[start:start+length]`` in order, fetched concurrently in chunks."""
    ranges = [ReadRange(key, off, min(_CHUNK, start + length - off))
              for off in range(start, start + length, _CHUNK)]
    waiting: dict[int, memoryview] = {}
    nxt = 0
    for index, buf in backend.read_ranges(ranges):
        waiting[index] = buf
        while nxt in waiting:
            yield waiting.pop(nxt)
            nxt += 1


def verify_checkpoint(uri: str, *, progress: Progress = no_progress, concurrency: int = 4,
                      **options: Any) -> VerifyReport:
    """Re-read every data file and check sizes and CRC32C against the manifest."""
    started = time.perf_counter()
    backend = open_backend(uri, **options)
    try:
        report = _verify(backend, uri, progress, concurrency)
    finally:
        backend.close()
    report.seconds = time.perf_counter() - started
    return report


def _verify(backend: Backend, uri: str, progress: Progress, concurrency: int) -> VerifyReport:
    report = VerifyReport(uri)
    md, raw = load_metadata(backend)
    source = f"{backend.uri}/.metadata"
    manifest = read_manifest(backend, layout.save_id_of_metadata(md, source=source),
                              required=True)
    names = {(i.relative_path, i.offset): idx.fqn for idx, i in (md.storage_data or {}).items()}
    check_references(md, manifest, source=source)  # a reference the save did not make
    if manifest is not None:
        try:
            manifest.check_metadata(raw, source=source)
        except IntegrityError as exc:
            report.errors.append(str(exc))
        try:
            check_one_save(md, manifest, source)
        except IntegrityError as exc:
            report.errors.append(str(exc))
        for index, info in (md.storage_data or {}).items():  # as the reader checks them
            try:
                known = manifest.item_crc(info.relative_path, info.offset, info.length)
            except IntegrityError as exc:
                report.errors.append(str(exc))
                continue
            if known is None:
                report.errors.append(f"{info.relative_path}: item {index.fqn!r} at offset "
                                     f"{info.offset} named by .metadata is not in the manifest")
    if manifest is None:
        report.has_manifest = False
        expected = {i.relative_path for i in (md.storage_data or {}).values()}
        records = {}
        for path in sorted(expected):
            try:
                size = backend.stat(path).size
            except FileNotFoundError:
                report.errors.append(f"{path}: missing")
                continue
            records[path] = FileRecord(size, -1, [])
    else:
        records = dict(manifest.files)
        records.update(manifest.references)  # follow references into sibling steps
    root_of = reference_source(backend, records)

    block = manifest.payload_block if manifest is not None else 0

    def check(path: str, rec: FileRecord) -> tuple[int, int, list[str]]:
        errors: list[str] = []
        store, key = root_of(path)
        try:
            size = store.stat(key).size
        except FileNotFoundError:
            held = [names[(path, o)] for o, _, _ in rec.items if (path, o) in names]
            return 0, 0, [f"{path}: missing" + (f" (holds items {', '.join(map(repr, held))})"
                                                 if held else "")]
        if size != rec.size:
            errors.append(f"{path}: size {size}, manifest says {rec.size}")
        file_crc = 0
        items = sorted(rec.items) or [(0, size, -1)]
        pos = 0
        for offset, length, item_crc in items:
            if offset != pos:
                errors.append(f"{path}: bytes {pos}-{offset} are not covered by any item")
            crc = 0
            payload = rec.payloads.get(offset)
            blocks = (BlockCRCs(block)
                      if payload is not None and payload.block_crcs and block else None)
            try:
                at = offset
                for chunk in ordered_chunks(store, key, offset, length):
                    crc = crc32c(chunk, crc)
                    file_crc = crc32c(chunk, file_crc)
                    if blocks is not None and payload is not None:  # its payload's bytes
                        lo = max(at, offset + payload.start)
                        hi = min(at + len(chunk), offset + payload.start + payload.nbytes)
                        if lo < hi:
                            blocks.feed(memoryview(chunk)[lo - at : hi - at])
                    at += len(chunk)
                    progress(len(chunk))
            except OSError as exc:
                errors.append(f"{path}: item {names.get((path, offset), '?')!r} unreadable: "
                              f"{exc}")
                return len(items), pos, errors
            if item_crc >= 0 and crc != item_crc:
                errors.append(
                    f"{path}: CRC32C mismatch in item {names.get((path, offset), '?')!r} "
                    f"(bytes {offset}-{offset + length}): expected {item_crc:08x}, got {crc:08x}"
                )
            elif blocks is not None and payload is not None:
                # the block CRCs reshard loads verify against must match the bytes too
                bad = [i for i, (want, got) in enumerate(
                    zip(payload.block_crcs, blocks.result(), strict=False)) if want != got]
                if bad or len(blocks.result()) != len(payload.block_crcs):
                    errors.append(
                        f"{path}: item {names.get((path, offset), '?')!r}: the manifest's "
                        f"payload block CRC32Cs do not match the data (blocks {bad[:5]}); the "
                        "manifest was modified after the save"
                    )
            pos = offset + length
        if rec.crc32c >= 0 and file_crc != rec.crc32c and not errors:
            errors.append(f"{path}: file CRC32C {file_crc:08x}, manifest says {rec.crc32c:08x}")
        return len(items), pos, errors

    try:
        with ThreadPoolExecutor(max(1, concurrency)) as pool:
            for n_items, n_bytes, errors in pool.map(lambda kv: check(*kv),
                                                     sorted(records.items())):
                report.files += 1
                report.items += n_items
                report.bytes += n_bytes
                report.errors += errors
    finally:
        store = root_of("")[0]
        if store is not backend:
            store.close()
    return report


def reference_source(backend: Backend, paths: Iterable[str]
                      ) -> Callable[[str], tuple[Backend, str]]:
    """Where each ``relative_path`` of a checkpoint is read: the checkpoint's own
    backend, or, for references into sibling steps, the run root."""
    if not any(is_reference(p) for p in paths):
        return lambda path: (backend, path)
    root, name = run_root(backend)

    def source(path: str) -> tuple[Backend, str]:
        if not path:
            return root, path
        return (root, root_key(name, path)) if is_reference(path) else (backend, path)

    return source
