"""The integrity manifest: size and CRC32C of every data file and every item in it.

Written by the coordinator just before ``.metadata`` as ``.dcpstore-<save_id>.json``.
``.metadata`` names the save id (``storage_meta.save_id``), so the commit point picks
exactly one manifest with one atomic write, and two concurrent saves can never pair one
save's ``.metadata`` with the other's manifest. torch's own readers ignore the file.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from dcpstore.dcp.checksum import crc32c
from dcpstore.errors import IntegrityError, UnsafeKeyError
from dcpstore.storage.uri import validate_key, validate_reference

__all__ = [
    "FileRecord",
    "Manifest",
    "Payload",
    "crc32c",
    "manifest_key",
]

FORMAT = "dcpstore-manifest"
VERSION = 1
SAVE_ID_PREFIX = "dcpstore-"
_DIGEST_RE = re.compile(r"^[0-9a-f]{32}$")


def manifest_key(save_id: str) -> str:
    """Key of the manifest of a save."""
    return f".dcpstore-{save_id.removeprefix(SAVE_ID_PREFIX)}.json"


class Payload(NamedTuple):
    """Where a tensor item's raw row-major bytes lie inside the item, and their block
    CRCs.

    Attributes:
        start: Offset of the first payload byte from the start of the item.
        nbytes: Length of the payload.
        block_crcs: CRC32C of every ``Manifest.payload_block`` bytes of the payload (the
            last block may be shorter); empty when not recorded.
        digest: XXH3-128 of the payload as 32 hex digits (``""``: not recorded). An
            incremental save compares it, with size, dtype and shape, to decide that a
            tensor is unchanged and can be referenced instead of written again.
    """

    start: int
    nbytes: int
    block_crcs: tuple[int, ...] = ()
    digest: str = ""


@dataclass
class FileRecord:
    """One data file: its size, CRC32C and the ``(offset, length, crc32c)`` of each item.

    ``payloads`` maps the offset of a tensor item to its :class:`Payload`. Readers use it
    to fetch a tensor's bytes straight into the destination tensor (no staging copy),
    and, on reshard loads, to fetch and verify only the blocks of the payload they need.
    """

    size: int
    crc32c: int
    items: list[tuple[int, int, int]] = field(default_factory=list)
    payloads: dict[int, Payload] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "size": self.size,
            "crc32c": f"{self.crc32c:08x}",
            "items": [list(i) for i in self.items],
        }
        if self.payloads:
            doc["payloads"] = [[o, p.start, p.nbytes, list(p.block_crcs)]
                               for o, p in sorted(self.payloads.items())]
            digests = [[o, p.digest] for o, p in sorted(self.payloads.items()) if p.digest]
            if digests:  # a list of its own: manifests without it read as before
                doc["digests"] = digests
        return doc

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FileRecord:
        digests = {int(o): str(d) for o, d in data.get("digests", [])}
        for digest in digests.values():
            if not _DIGEST_RE.match(digest):
                raise ValueError(f"payload digest {digest!r} is not 32 hex digits")
        payloads = {}
        for entry in data.get("payloads", []):
            offset, start, nbytes, *rest = entry
            crcs = tuple(int(c) for c in rest[0]) if rest else ()
            payloads[int(offset)] = Payload(int(start), int(nbytes), crcs,
                                            digests.get(int(offset), ""))
        return cls(
            size=int(data["size"]),
            crc32c=int(data["crc32c"], 16),
            items=[(int(o), int(n), int(c)) for o, n, c in data.get("items", [])],
            payloads=payloads,
        )


@dataclass
class Manifest:
    """Everything a reader needs to prove the bytes it got are the bytes that were saved."""

    save_id: str
    world_size: int
    files: dict[str, FileRecord]
    dcpstore_version: str = ""
    torch_version: str = ""
    created: float = field(default_factory=time.time)
    extra: dict[str, Any] = field(default_factory=dict)
    #: Size and CRC32C of the ``.metadata`` committed with this manifest (``None`` in
    #: manifests written before it was recorded).
    metadata: FileRecord | None = None
    #: Block size of the payloads' block CRCs (0: none recorded).
    payload_block: int = 0
    #: Data files of sibling steps this checkpoint references (an incremental save),
    #: by the ``relative_path`` ``.metadata`` uses (``../step-000000100/__0_0.<save>.distcp``),
    #: with the record copied from the manifest of the step that wrote them.
    references: dict[str, FileRecord] = field(default_factory=dict)
    _item_index: dict[tuple[str, int], tuple[int, int]] | None = field(
        default=None, repr=False, compare=False
    )

    @property
    def total_bytes(self) -> int:
        """Bytes of the data files this save wrote (referenced files not counted)."""
        return sum(f.size for f in self.files.values())

    def record(self, relative_path: str) -> FileRecord | None:
        """The record of a data file this checkpoint reads: its own or a referenced one."""
        found = self.files.get(relative_path)
        return found if found is not None else self.references.get(relative_path)

    def to_bytes(self) -> bytes:
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "save_id": self.save_id,
            "world_size": self.world_size,
            "created": self.created,
            "dcpstore_version": self.dcpstore_version,
            "torch_version": self.torch_version,
            "extra": self.extra,
            "files": {k: v.to_json() for k, v in sorted(self.files.items())},
        }
        if self.metadata is not None:
            doc["metadata"] = self.metadata.to_json()
        if self.payload_block:
            doc["payload_block"] = self.payload_block
        if self.references:
            doc["references"] = {k: v.to_json() for k, v in sorted(self.references.items())}
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, source: str = ".dcpstore json") -> Manifest:
        """Parse a manifest.

        Raises:
            IntegrityError: The document is not a dcpstore manifest or is damaged.
            UnsafeKeyError: It lists a data file outside the checkpoint root.
        """
        try:
            doc = json.loads(data)
            if doc.get("format") != FORMAT:
                raise ValueError(f"format is {doc.get('format')!r}, expected {FORMAT!r}")
            if int(doc.get("version", 0)) > VERSION:
                raise ValueError(
                    f"manifest version {doc['version']} is newer than this dcpstore "
                    f"understands ({VERSION}); upgrade dcpstore"
                )
            files = {}
            for key, record in doc["files"].items():
                try:
                    validate_key(key)
                except UnsafeKeyError as exc:
                    raise UnsafeKeyError(f"{source}: {exc}") from None
                files[key] = FileRecord.from_json(record)
            references = {}
            for key, record in doc.get("references", {}).items():
                try:
                    validate_reference(key)
                except UnsafeKeyError as exc:
                    raise UnsafeKeyError(f"{source}: {exc}") from None
                references[key] = FileRecord.from_json(record)
            metadata = doc.get("metadata")
            return cls(
                save_id=str(doc["save_id"]),
                world_size=int(doc["world_size"]),
                files=files,
                dcpstore_version=str(doc.get("dcpstore_version", "")),
                torch_version=str(doc.get("torch_version", "")),
                created=float(doc.get("created", 0.0)),
                extra=dict(doc.get("extra", {})),
                metadata=None if metadata is None else FileRecord.from_json(metadata),
                payload_block=int(doc.get("payload_block", 0)),
                references=references,
            )
        except UnsafeKeyError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise IntegrityError(f"{source} is not a valid dcpstore manifest: {exc}") from exc

    def check_metadata(self, raw: bytes, *, source: str = ".metadata") -> None:
        """Check the bytes of ``.metadata`` against the size and CRC32C recorded here
        (nothing to check in manifests that predate the record).

        Raises:
            IntegrityError: ``.metadata`` is not the one committed with this manifest.
        """
        if self.metadata is not None:
            self.check_metadata_digest(len(raw), crc32c(raw), source=source)

    def check_metadata_digest(self, size: int, actual: int, *, source: str = ".metadata"
                              ) -> None:
        """:meth:`check_metadata` for a ``.metadata`` of ``size`` bytes whose CRC32C is
        ``actual`` (its bytes need not be kept until the check).

        Raises:
            IntegrityError: ``.metadata`` is not the one committed with this manifest.
        """
        if self.metadata is None:
            return
        if size != self.metadata.size or actual != self.metadata.crc32c:
            raise IntegrityError(
                f"{source} is damaged: {size} bytes with CRC32C {actual:08x}, the "
                f"manifest {manifest_key(self.save_id)} recorded {self.metadata.size} bytes "
                f"with CRC32C {self.metadata.crc32c:08x} (one of the two was modified after "
                "the save); restore it or load an older checkpoint"
            )

    def header(self) -> Manifest:
        """This manifest without item records: what every rank of a load needs before
        its plan is known (save id, ``.metadata`` record, the files it references)."""
        return dataclasses.replace(
            self, files={},
            references={k: FileRecord(r.size, r.crc32c) for k, r in self.references.items()},
            _item_index=None)

    def item_crc(self, relative_path: str, offset: int, length: int) -> int | None:
        """CRC32C recorded for the item at ``offset`` of ``relative_path``, if any.

        Raises:
            IntegrityError: The manifest records a different length for that item.
        """
        if self._item_index is None:
            self._item_index = {
                (path, o): (n, c)
                for records in (self.files, self.references)
                for path, rec in records.items() for o, n, c in rec.items
            }
        found = self._item_index.get((relative_path, offset))
        if found is None:
            return None
        if found[0] != length:
            raise IntegrityError(
                f"{relative_path} @ {offset}: .metadata says {length} bytes, the manifest "
                f"says {found[0]}; the checkpoint was modified after it was written"
            )
        return found[1]

    def subset(self, items: Iterable[tuple[str, int]]) -> Manifest:
        """This manifest restricted to the records of ``items`` (``(relative_path,
        offset)`` of the items one rank reads) and the files that hold them.

        The coordinator of a load sends each rank its subset in the load plan, so a rank
        holds a record per item it reads, not per item of the checkpoint. Everything else
        (save id, ``.metadata`` record, block size) is kept; a referenced file keeps its
        place in ``references``.
        """
        wanted: dict[str, set[int]] = {}
        for path, offset in items:
            wanted.setdefault(path, set()).add(offset)

        def cut(records: dict[str, FileRecord]) -> dict[str, FileRecord]:
            out = {}
            for path, offsets in wanted.items():  # this rank's files only
                rec = records.get(path)
                if rec is None:
                    continue
                out[path] = FileRecord(
                    rec.size, rec.crc32c, [i for i in rec.items if i[0] in offsets],
                    {o: p for o, p in rec.payloads.items() if o in offsets})
            return out

        return dataclasses.replace(self, files=cut(self.files),
                                   references=cut(self.references), _item_index=None)

    @property
    def item_count(self) -> int:
        """Item records held (own files and referenced ones)."""
        return sum(len(r.items) for records in (self.files, self.references)
                   for r in records.values())

    def item_payload(self, relative_path: str, offset: int) -> Payload | None:
        """Where the raw tensor bytes of an item lie, if recorded."""
        record = self.record(relative_path)
        return None if record is None else record.payloads.get(offset)
