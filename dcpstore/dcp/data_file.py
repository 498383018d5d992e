"""One data file of a save: the items of a rank's plan streamed into one upload, each
item's CRC32C (and its payload's block CRCs and content hash) computed as its bytes go
by, and the :class:`~dcpstore.dcp.manifest.FileRecord` the manifest keeps of the file."""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from typing_extensions import Buffer

from dcpstore import errors
from dcpstore.dcp.checksum import crc32c, crc32c_combine
from dcpstore.dcp.codec import encode_tensor
from dcpstore.dcp.incremental import _BaseItem, _ChunkKey, _unchanged
from dcpstore.dcp.manifest import FileRecord, Payload
from dcpstore.storage.backend import Backend, Upload
from dcpstore.torch_internals import StorageWriterTransforms

__all__ = ["PAYLOAD_BLOCK"]

logger = logging.getLogger(__name__)

# Tensors at least this large get their payload position recorded in the manifest, so
# readers can fetch their bytes straight into the destination.
_MIN_PAYLOAD = 4096
#: Payloads get a CRC32C per block of this many bytes: a reshard load that needs part of
#: a tensor reads and verifies whole blocks around it, not the whole item.
PAYLOAD_BLOCK = 1024 * 1024
# Writes at least this large are checksummed once and combined into the item and file
# CRCs; smaller ones (archive headers) are cheaper to checksum twice than to combine.
_COMBINE_MIN = 64 * 1024


@dataclass
class _WrittenItem:
    """``WriteResult.storage_data`` on its way to the coordinator."""

    relative_path: str
    offset: int
    length: int
    transform_descriptors: Sequence[str] | None
    crc32c: int
    file: FileRecord | None = None  # set on the last item of each file
    reference: bool = False  # bytes of a sibling step (an incremental save)


class _ChecksumStream(io.RawIOBase):
    """Write-only stream into an :class:`Upload` that tracks position and CRC32C (of the
    file and of the current item; one pass over every large write)."""

    def __init__(self, upload: Upload) -> None:
        self.upload = upload
        self.position = 0
        self.file_crc = 0
        self.item_crc = 0
        # writes of exactly ``_payload_size`` bytes (a tensor's storage): where each began
        # and the CRC32C of each PAYLOAD_BLOCK of it
        self._payload_size = 0
        self.payload_at: list[tuple[int, tuple[int, ...]]] = []
        self._want_digest = False
        self.payload_digest = ""

    def expect_payload(self, nbytes: int, *, digest: bool = False) -> None:
        """Note position and block CRCs of writes of ``nbytes`` bytes until the next call
        (and, with ``digest``, their XXH3-128 in :attr:`payload_digest`)."""
        self._payload_size = nbytes
        self.payload_at = []
        self._want_digest = digest
        self.payload_digest = ""

    def writable(self) -> bool:
        return True

    def write(self, data: Buffer) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        self.upload.write(view)
        if size and size == self._payload_size:
            blocks = []
            crc = 0
            # the content hash in the same pass, block by block, while each is in cache
            hasher = xxhash.xxh3_128() if self._want_digest else None
            for lo in range(0, size, PAYLOAD_BLOCK):
                block = view[lo : lo + PAYLOAD_BLOCK]
                blocks.append(crc32c(block))
                crc = crc32c_combine(crc, blocks[-1], len(block))
                if hasher is not None:
                    hasher.update(block)
            if hasher is not None:
                self.payload_digest = hasher.hexdigest()
            self.payload_at.append((self.position, tuple(blocks)))
            self._combine(crc, size)
        elif size >= _COMBINE_MIN:
            self._combine(crc32c(view), size)
        else:
            self.file_crc = crc32c(view, self.file_crc)
            self.item_crc = crc32c(view, self.item_crc)
        self.position += size
        return size

    def _combine(self, crc: int, size: int) -> None:
        self.file_crc = crc32c_combine(self.file_crc, crc, size)
        self.item_crc = crc32c_combine(self.item_crc, crc, size)

    def tell(self) -> int:
        return self.position

    def close(self) -> None:  # the upload is committed or aborted by its owner
        pass


def _prepare_tensor(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        # a view into a larger storage: torch.save would write the whole storage
        tensor = tensor.clone()
    return tensor


def _write_data_file(
    backend: Backend, name: str, items: Sequence[WriteItem], planner: SavePlanner, *,
    extensions: Sequence[Any], content_hash: bool, frozen: frozenset[str],
    base: dict[_ChunkKey, _BaseItem] | None = None, size_hint: int | None = None,
) -> list[WriteResult]:
    """Write one data file of ``items`` to ``backend`` at ``name``, in one streaming
    upload: each item's bytes through ``extensions`` (DCP stream transforms), with its
    CRC32C and, for large plain tensors, its payload's position, block CRCs and (with
    ``content_hash``) XXH3-128. A tensor chunk the incremental ``base`` holds unchanged
    becomes a reference instead (not hashed for keys in ``frozen``); a file all of whose
    items are references is not written. The last written item carries the file's
    :class:`~dcpstore.dcp.manifest.FileRecord`."""
    started = time.perf_counter()
    upload = backend.open_upload(name, size_hint=size_hint)
    stream = _ChecksumStream(upload)
    transforms = StorageWriterTransforms(extensions) if extensions else None
    written: list[tuple[WriteItem, _WrittenItem]] = []
    referenced: list[tuple[WriteItem, _WrittenItem]] = []
    records: list[tuple[int, int, int]] = []
    payloads: dict[int, Payload] = {}
    try:
        # byte items first, like torch's writer; then tensors
        ordered = sorted(items, key=lambda i: i.type != WriteItemType.BYTE_IO)
        for item in ordered:
            offset = stream.position
            stream.item_crc = 0
            data = planner.resolve_data(item)
            sink: Any = stream
            descriptors: list[str] = []
            digest = ""
            want_digest = False
            if item.type != WriteItemType.BYTE_IO:
                if not isinstance(data, torch.Tensor):
                    raise TypeError(f"tensor item {item.index.fqn!r} resolved to {type(data)}")
                tensor = _prepare_tensor(data)
                hashable = (transforms is None and tensor.is_contiguous()
                            and tensor.nbytes >= _MIN_PAYLOAD)
                same, digest = (_unchanged(item, tensor, base, frozen) if hashable
                                else (None, ""))
                if same is not None:
                    ref = _WrittenItem(same.path, same.offset, same.length, None,
                                       same.crc32c, reference=True)
                    referenced.append((item, ref))
                    continue
                want_digest = hashable and content_hash and not digest
            if transforms is not None:
                sink, descriptors = transforms.transform_save_stream(item, stream)
            if item.type == WriteItemType.BYTE_IO:
                if not isinstance(data, io.BytesIO):
                    raise TypeError(f"byte item {item.index.fqn!r} resolved to {type(data)}")
                sink.write(data.getbuffer())
            else:
                stream.expect_payload(tensor.nbytes, digest=want_digest)
                encode_tensor(tensor, sink)
                if (transforms is None and tensor.is_contiguous()
                        and tensor.nbytes >= _MIN_PAYLOAD and len(stream.payload_at) == 1):
                    at, crcs = stream.payload_at[0]
                    digest = digest or stream.payload_digest
                    payloads[offset] = Payload(at - offset, tensor.nbytes, crcs, digest)
                stream.expect_payload(0)
            if transforms is not None:
                sink.close()
            length = stream.position - offset
            record = _WrittenItem(name, offset, length, descriptors or None, stream.item_crc)
            written.append((item, record))
            records.append((offset, length, stream.item_crc))
        if not written:  # every item is referenced: no empty file
            upload.abort()
            return [WriteResult(index=item.index, size_in_bytes=0, storage_data=rec)
                    for item, rec in referenced]
        info = upload.commit()
    except BaseException:
        upload.abort()
        raise
    if info.size != stream.position:
        raise errors.DcpstoreError(
            f"{name}: backend stored {info.size} bytes, {stream.position} were written"
        )
    elapsed = time.perf_counter() - started
    logger.debug("wrote %s: %d items, %d bytes in %.3fs (%d items referenced)", name,
                 len(written), stream.position, elapsed, len(referenced))
    written[-1][1].file = FileRecord(stream.position, stream.file_crc, records, payloads)
    return [
        WriteResult(index=item.index, size_in_bytes=rec.length, storage_data=rec)
        for item, rec in written
    ] + [
        WriteResult(index=item.index, size_in_bytes=0, storage_data=rec)
        for item, rec in referenced
    ]
