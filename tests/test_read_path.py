"""The zero-copy read path: item codec, scatter reads straight into destination tensors.

Proves that tensor payloads land in the destination without staging copies when they
can (counted by ``Reader.items_direct``), that every other case (dtype casts,
non-contiguous destinations, resharding slices, checkpoints from torch's writer) still
loads bit-exact through the staged path, and that a manifest pointing the payload at
the wrong bytes fails loudly instead of filling tensors with garbage.
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from stores import memory_scheme
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

import dcpstore
from dcpstore.dcp.checksum import crc32c
from dcpstore.dcp.codec import decode_tensor, encode_tensor
from dcpstore.dcp.manifest import Payload
from dcpstore.dcp.writer import PAYLOAD_BLOCK
from dcpstore.testing import assert_state_equal, many_dtypes_state
from dcpstore.tools.ops import verify_checkpoint

# -- codec ---------------------------------------------------------------------------------

DTYPES_AND_SHAPES = [
    (torch.float32, (3, 4)), (torch.float64, (5,)), (torch.float16, (2, 2, 2)),
    (torch.bfloat16, ()), (torch.int64, (7,)), (torch.int8, (0,)), (torch.bool, (9,)),
    (torch.complex64, (2, 3)), (torch.float8_e4m3fn, (16,)), (torch.uint8, (1000,)),
]


@pytest.mark.parametrize(("dtype", "shape"), DTYPES_AND_SHAPES)
@pytest.mark.parametrize("encoder", ["dcpstore", "torch.save"])
def test_codec_round_trip_shares_memory(dtype: torch.dtype, shape: tuple[int, ...],
                                        encoder: str) -> None:
    t = torch.randn(shape).to(dtype) if dtype.is_floating_point or dtype.is_complex else (
        torch.randint(0, 2 if dtype == torch.bool else 100, shape).to(dtype))
    buf = io.BytesIO()
    (encode_tensor if encoder == "dcpstore" else torch.save)(t, buf)
    raw = bytearray(buf.getvalue())
    decoded = decode_tensor(memoryview(raw))
    assert decoded.dtype == t.dtype and decoded.shape == t.shape
    assert torch.equal(decoded.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
    if t.numel():  # zero-copy: the storage is the fetched buffer
        base = torch.frombuffer(raw, dtype=torch.uint8).data_ptr()
        assert base <= decoded.data_ptr() < base + len(raw)
    # torch.load reads what dcpstore wrote (no zip CRC32, torch does not check it)
    assert torch.equal(torch.load(io.BytesIO(bytes(raw)), weights_only=True)
                       .reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


def test_codec_read_only_buffer_falls_back_to_torch_load() -> None:
    t = torch.arange(100.0)
    buf = io.BytesIO()
    encode_tensor(t, buf)
    assert torch.equal(decode_tensor(memoryview(buf.getvalue())), t)


def test_codec_refuses_code_and_non_tensors(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (open, (str(marker), "w"))

    for obj in (Payload(), {"a": torch.zeros(2)}):
        buf = io.BytesIO()
        torch.save(obj, buf)
        with pytest.raises(pickle.UnpicklingError):
            decode_tensor(memoryview(bytearray(buf.getvalue())))
    assert not marker.exists()


def test_codec_damaged_archive_is_an_error() -> None:
    buf = io.BytesIO()
    encode_tensor(torch.arange(64.0), buf)
    raw = bytearray(buf.getvalue())
    with pytest.raises(RuntimeError):
        decode_tensor(memoryview(raw[: len(raw) // 2]))


def test_codec_decodes_each_archive_layout_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from dcpstore.dcp import codec

    monkeypatch.setattr(codec, "_LAYOUTS", codec._Layouts())
    parsed: list[int] = []
    full = codec._decode_in_place
    monkeypatch.setattr(codec, "_decode_in_place", lambda v: parsed.append(1) or full(v))

    def archive(t: torch.Tensor, writer: Any = encode_tensor) -> bytearray:
        buf = io.BytesIO()
        writer(t, buf)
        return bytearray(buf.getvalue())

    layers = [torch.randn(64, 32) for _ in range(6)]
    raws = [archive(t) for t in layers]
    for t, raw in zip(layers, raws, strict=True):
        decoded = decode_tensor(memoryview(raw))
        assert torch.equal(decoded, t) and decoded.stride() == t.stride()
        base = torch.frombuffer(raw, dtype=torch.uint8).data_ptr()
        assert base <= decoded.data_ptr() < base + len(raw)  # still zero-copy
    assert len(parsed) == 1  # six same-shaped layers: one zip parse and unpickle
    # a scatter read (head, payload in its destination, tail) matches the same layout
    raw = raws[0]
    start = bytes(raw).index(bytes(layers[0].numpy().tobytes()[:64]))
    stop = start + 64 * 32 * 4
    target = torch.empty(64, 32)
    target.view(-1).view(torch.uint8)[:] = torch.frombuffer(raw[start:stop], dtype=torch.uint8)
    pieces = [memoryview(raw)[:start], memoryview(target.numpy()).cast("B"),
              memoryview(raw)[stop:]]
    assert decode_tensor(pieces).data_ptr() == target.data_ptr() and len(parsed) == 1
    # another dtype or shape, and torch's own archives (a CRC32 per record: the bytes
    # outside the payload differ per content), are parsed in full
    decode_tensor(memoryview(archive(torch.randn(32, 64))))
    decode_tensor(memoryview(archive(torch.randn(64, 32).double())))
    assert len(parsed) == 3
    for t in layers[:2]:
        assert torch.equal(decode_tensor(memoryview(archive(t, torch.save))), t)
    assert len(parsed) == 5
    # a byte changed outside the payload is no match: the archive is parsed (and refused)
    tampered = bytearray(raws[1])
    at = bytes(tampered).index(b"_rebuild_tensor_v2")
    tampered[at:at + 4] = b"XXXX"
    with pytest.raises(pickle.UnpicklingError, match="XXXXuild_tensor_v2"):
        decode_tensor(memoryview(tampered))
    assert len(parsed) == 6


# -- reader --------------------------------------------------------------------------------


def _big_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {
        "w": torch.randn(300, 200, generator=g),
        "b": torch.randn(4096, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 1 << 40, (2048,), generator=g),
        "tiny": torch.randn(3, generator=g),  # below the payload threshold: staged
    }


def _load(state: dict, uri: Path) -> dcpstore.Reader:
    reader = dcpstore.get_reader(uri)
    dcp.load(state, storage_reader=reader, no_dist=True)
    return reader


def test_payloads_are_read_straight_into_destination(tmp_path: Path) -> None:
    state = _big_state()
    dcpstore.save(state, tmp_path / "c")
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    ptrs = {k: v.data_ptr() for k, v in out.items()}
    reader = _load(out, tmp_path / "c")
    assert_state_equal(out, state)
    assert {k: v.data_ptr() for k, v in out.items()} == ptrs  # filled in place
    assert reader.items_direct == 3
    assert reader.bytes_read == reader.bytes_needed


@pytest.mark.parametrize("where", ["local", "memory"])
def test_large_payloads_are_checksummed_by_the_read(tmp_path: Path, where: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A payload read straight into its tensor is checksummed by the read (the local
    store in cache-sized steps as it reads; another store right after the request), not
    read again by the delivery; a flipped payload byte is still caught."""
    from dcpstore.dcp import delivery
    from dcpstore.storage import local

    state = {"big": torch.randn(3 << 18), "small": torch.randn(64)}  # 3 MiB and 256 B
    checked: list[int] = []  # lengths the delivery checksums itself
    monkeypatch.setattr(delivery, "crc32c",
                        lambda data, value=0: checked.append(len(data)) or crc32c(data, value))
    stepped: list[int] = []
    real_step = local._pread_into
    monkeypatch.setattr(local, "_pread_into",
                        lambda fd, path, pos, outs: stepped.append(sum(map(len, outs)))
                        or real_step(fd, path, pos, outs))
    with contextlib.ExitStack() as stack:
        uri: Any = tmp_path / "c"
        if where == "memory":
            stack.enter_context(contextlib.contextmanager(memory_scheme)("crc"))
            uri = "memory://crc/c"
        dcpstore.save(state, uri)
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        assert _load(out, uri).items_direct == 1  # the big one (the small one is staged)
        assert_state_equal(out, state)
        assert checked and max(checked) < 4096  # headers, tails, the small item
        if where == "local":  # the big payload in steps of at most 512 KiB
            assert stepped.count(512 * 1024) == 6
        # one payload byte flipped: caught by the checksum the read computed
        backend = dcpstore.get_reader(uri).backend
        [key] = [o.key for o in backend.list("") if o.key.startswith("__")]
        data = bytearray(backend.get(key))
        at = bytes(data).index(state["big"][1000:1016].numpy().tobytes())
        data[at] ^= 1
        backend.put(key, bytes(data))
        with pytest.raises(dcpstore.IntegrityError, match="CRC32C mismatch in item 'big'"):
            dcpstore.load({k: torch.zeros_like(v) for k, v in state.items()}, uri)


def test_every_dtype_and_view_round_trips(tmp_path: Path) -> None:
    state = many_dtypes_state(seed=21)
    dcpstore.save(state, tmp_path / "c")
    out = many_dtypes_state(seed=22)  # same structure, other values
    _load(out, tmp_path / "c")
    assert_state_equal(out, state)


def test_dtype_cast_and_non_contiguous_destinations_take_the_staged_path(
    tmp_path: Path,
) -> None:
    state = _big_state()
    dcpstore.save(state, tmp_path / "c")
    out = {
        "w": torch.zeros(200, 300).t(),  # non-contiguous destination
        "b": torch.zeros(4096, dtype=torch.float32),  # saved as bf16: DCP casts on copy
        "ids": torch.zeros(2048, dtype=torch.int64),
        "tiny": torch.zeros(3),
    }
    reader = _load(out, tmp_path / "c")
    assert reader.items_direct == 1  # only "ids"
    assert torch.equal(out["w"], state["w"])
    assert torch.equal(out["b"], state["b"].float())
    assert torch.equal(out["ids"], state["ids"])


def test_torch_writer_checkpoint_has_no_payloads_and_loads(tmp_path: Path) -> None:
    state = _big_state()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "t")), no_dist=True)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    reader = _load(out, tmp_path / "t")
    assert_state_equal(out, state)
    assert reader.items_direct == 0


def test_manifest_pointing_payload_elsewhere_fails_loudly(tmp_path: Path) -> None:
    state = {"w": torch.randn(4096)}
    dcpstore.save(state, tmp_path / "c")
    (manifest_path,) = (tmp_path / "c").glob(".dcpstore-*.json")
    doc = json.loads(manifest_path.read_text())
    for rec in doc["files"].values():
        rec["payloads"] = [[o, s + 64, n, crcs] for o, s, n, crcs in rec["payloads"]]
    manifest_path.write_text(json.dumps(doc))
    out = {"w": torch.zeros(4096)}
    with pytest.raises(dcpstore.IntegrityError, match="does not lie where the manifest"):
        dcpstore.load(out, tmp_path / "c")


# -- reshard requests: only the payload blocks a rank needs -------------------------------


class _SlicePlanner:
    """The two calls ``Reader.read_data`` makes of a load planner, with one destination
    tensor that holds a slice of the saved tensor (a reshard's local shard)."""

    def __init__(self, dest: torch.Tensor) -> None:
        self.dest = dest
        self.committed = 0

    def resolve_tensor(self, req: Any) -> torch.Tensor:
        return narrow_tensor_by_index(self.dest, req.dest_offsets, req.lengths)

    def commit_tensor(self, req: Any, tensor: torch.Tensor) -> None:
        self.committed += 1


def _read_slice(uri: Path, fqn: str, offsets: tuple[int, ...], dest: torch.Tensor
                ) -> dcpstore.Reader:
    reader = dcpstore.get_reader(uri)
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=dest.size())
    items = create_read_items_for_chunk_list(fqn, metadata.state_dict_metadata[fqn], [chunk])
    planner = _SlicePlanner(dest)
    reader.read_data(LoadPlan(items), planner).wait()  # type: ignore[arg-type]
    assert planner.committed == len(items)
    return reader


def _payload_of(uri: Path, fqn: str) -> tuple[Path, int, Payload]:
    """File, absolute payload offset and payload record of a saved tensor."""
    reader = dcpstore.get_reader(uri)
    metadata = reader.read_metadata()
    (info,) = [i for k, i in metadata.storage_data.items() if k.fqn == fqn]
    assert reader.manifest is not None
    payload = reader.manifest.item_payload(info.relative_path, info.offset)
    assert payload is not None
    return uri / info.relative_path, info.offset + payload.start, payload


ROWS = (8000, 256)  # 8 MB of float32: eight 1 MiB payload blocks


def test_reshard_rows_read_only_their_blocks_straight_into_destination(
    tmp_path: Path,
) -> None:
    w = torch.randn(ROWS, generator=torch.Generator().manual_seed(3))
    dcpstore.save({"w": w}, tmp_path / "c")
    dest = torch.zeros(1000, 256)
    ptr = dest.data_ptr()
    reader = _read_slice(tmp_path / "c", "w", (3000, 0), dest)
    assert torch.equal(dest, w[3000:4000]) and dest.data_ptr() == ptr
    assert (reader.items_partial, reader.items_direct) == (1, 1)
    assert reader.bytes_needed == dest.nbytes
    # the whole blocks around the rows: at most one block more on each side
    assert dest.nbytes <= reader.bytes_read <= dest.nbytes + 2 * PAYLOAD_BLOCK
    assert reader.bytes_read < w.nbytes // 2


def test_reshard_rows_on_block_boundaries(tmp_path: Path) -> None:
    w = torch.randn(ROWS, generator=torch.Generator().manual_seed(7))
    dcpstore.save({"w": w}, tmp_path / "c")
    rows = PAYLOAD_BLOCK // (256 * 4)  # one block of rows: nothing staged around them
    dest = torch.zeros(rows, 256)
    reader = _read_slice(tmp_path / "c", "w", (rows, 0), dest)
    assert torch.equal(dest, w[rows : 2 * rows])
    assert (reader.items_direct, reader.bytes_read) == (1, PAYLOAD_BLOCK)
    tail = torch.zeros(8000 - 7 * rows, 256)  # the last, shorter block
    reader = _read_slice(tmp_path / "c", "w", (7 * rows, 0), tail)
    assert torch.equal(tail, w[7 * rows :])
    assert reader.bytes_read == tail.nbytes


def test_reshard_column_block_is_staged_and_narrowed(tmp_path: Path) -> None:
    w = torch.randn(ROWS, generator=torch.Generator().manual_seed(4))
    dcpstore.save({"w": w}, tmp_path / "c")
    dest = torch.zeros(1000, 100)
    reader = _read_slice(tmp_path / "c", "w", (2000, 50), dest)
    assert torch.equal(dest, w[2000:3000, 50:150])
    assert (reader.items_partial, reader.items_direct) == (1, 0)
    assert reader.bytes_read <= 1000 * 256 * 4 + 2 * PAYLOAD_BLOCK


def test_reshard_spanning_every_block_reads_the_whole_item(tmp_path: Path) -> None:
    w = torch.randn(ROWS, generator=torch.Generator().manual_seed(5))
    dcpstore.save({"w": w}, tmp_path / "c")
    dest = torch.zeros(8000, 128)  # every row: every block is needed anyway
    reader = _read_slice(tmp_path / "c", "w", (0, 64), dest)
    assert torch.equal(dest, w[:, 64:192])
    assert reader.items_partial == 0  # whole item, whole-item CRC


def test_reshard_read_verifies_its_blocks(tmp_path: Path) -> None:
    w = torch.randn(ROWS, generator=torch.Generator().manual_seed(6))
    dcpstore.save({"w": w}, tmp_path / "c")
    path, start, payload = _payload_of(tmp_path / "c", "w")
    assert len(payload.block_crcs) == -(-w.nbytes // PAYLOAD_BLOCK)
    raw = bytearray(path.read_bytes())
    inside = start + 3500 * 256 * 4 + 17  # a byte of row 3500
    raw[inside] ^= 0x10
    path.write_bytes(raw)
    with pytest.raises(dcpstore.IntegrityError, match="payload block"):
        _read_slice(tmp_path / "c", "w", (3000, 0), torch.zeros(1000, 256))
    # rows far from the damage are served, verified block by block
    dest = torch.zeros(1000, 256)
    _read_slice(tmp_path / "c", "w", (6000, 0), dest)
    assert torch.equal(dest, w[6000:7000])
    # a whole-tensor load checks the whole item and refuses
    with pytest.raises(dcpstore.IntegrityError, match="CRC32C mismatch"):
        dcpstore.load({"w": torch.zeros(ROWS)}, tmp_path / "c")


def test_verify_checks_payload_block_crcs(tmp_path: Path) -> None:
    w = torch.randn(ROWS, generator=torch.Generator().manual_seed(8))
    dcpstore.save({"w": w}, tmp_path / "c")
    assert verify_checkpoint(str(tmp_path / "c")).ok
    (manifest_path,) = (tmp_path / "c").glob(".dcpstore-*.json")
    doc = json.loads(manifest_path.read_text())
    for rec in doc["files"].values():
        for entry in rec["payloads"]:
            entry[3][5] ^= 1  # one block CRC of each payload, the data untouched
    manifest_path.write_text(json.dumps(doc))
    report = verify_checkpoint(str(tmp_path / "c"))
    assert not report.ok
    assert any("payload block CRC32Cs do not match" in e and "[5]" in e for e in report.errors)
    # a reshard read of that block refuses it; whole-tensor loads (item CRC) still work
    with pytest.raises(dcpstore.IntegrityError, match="payload block"):
        _read_slice(tmp_path / "c", "w", (5 * 1024, 0), torch.zeros(1024, 256))
    out = {"w": torch.zeros(ROWS)}
    dcpstore.load(out, tmp_path / "c")
    assert torch.equal(out["w"], w)
