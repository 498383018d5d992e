"""Model weights out of a checkpoint: ``load_model_weights`` and ``export``.

``load_model_weights`` loads just the model from a DCP checkpoint (wherever the model
sits in it: top level, under ``model.`` or ``app.model.``) or from a ``torch.save`` file,
into a plain or distributed model, at any world size. ``export`` consolidates a sharded
checkpoint into one ``torch.save`` or safetensors file; safetensors output is streamed a
batch of tensors at a time, never holding the whole model twice.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from dcpstore.dcp.api import get_reader
from dcpstore.dcp.dist import is_distributed, single_process_quiet
from dcpstore.dcp.reader import Reader
from dcpstore.errors import CheckpointMismatchError, DcpstoreError
from dcpstore.storage.resolve import open_backend
from dcpstore.storage.uri import parse_uri
from dcpstore.training.collectives import Collectives

__all__ = ["export", "load_model_weights", "read_metadata"]

logger = logging.getLogger(__name__)

_MODEL_PREFIXES = ("", "model.", "app.model.", "state.model.", "module.")

_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


@contextmanager
def _reader(uri: str, **options: Any) -> Iterator[Reader]:
    """A reader whose backend (thread pool, clients) is closed when the block ends."""
    reader = get_reader(uri, **options)
    try:
        yield reader
    finally:
        reader.backend.close()


def read_metadata(uri: str, **options: Any) -> Metadata:
    """The DCP ``Metadata`` of a checkpoint (restricted unpickle, manifest checked)."""
    with _reader(uri, **options) as reader:
        return reader.read_metadata()


def _is_torch_file(uri: str) -> bool:
    parsed = parse_uri(uri)
    return parsed.scheme == "file" and os.path.isfile(parsed.location)


def _model_prefix(keys: list[str], saved: dict[str, Any]) -> str:
    for prefix in _MODEL_PREFIXES:
        if keys and all(prefix + k in saved for k in keys):
            return prefix
    best = max(_MODEL_PREFIXES, key=lambda p: sum(p + k in saved for k in keys))
    missing = [k for k in keys if best + k not in saved]
    raise CheckpointMismatchError(
        f"the checkpoint does not hold this model's weights: {len(missing)} of {len(keys)} "
        f"keys missing (e.g. {', '.join(missing[:5])}); checkpoint keys look like "
        f"{', '.join(list(saved)[:5])}"
    )


def load_model_weights(model: nn.Module, uri: str, *, strict: bool = True,
                       **options: Any) -> None:
    """Load a model's weights alone from a checkpoint, at any world size.

    Args:
        model: A plain, DDP, FSDP2 or DTensor-parallel model (collective if distributed).
        uri: A DCP checkpoint, or a local ``torch.save`` file of a state dict.
        strict: Every model key must be in the checkpoint.
        **options: Reader/backend options.

    Raises:
        CheckpointMismatchError: Keys or shapes do not match (``strict``).
    """
    if _is_torch_file(uri):
        full = torch.load(parse_uri(uri).location, map_location="cpu", weights_only=True)
        if isinstance(full, dict) and "model" in full and isinstance(full["model"], dict):
            full = full["model"]
        set_model_state_dict(
            model, full, options=StateDictOptions(full_state_dict=True, strict=strict)
        )
        return
    with _reader(uri, **options) as reader:
        saved = _saved_keys(reader)
        target = get_model_state_dict(model)
        keys = list(target)
        if strict:
            prefix = _model_prefix(keys, saved)
        else:
            prefix = max(_MODEL_PREFIXES, key=lambda p: sum(p + k in saved for k in keys))
            keys = [k for k in keys if prefix + k in saved]
        flat = {prefix + k: target[k] for k in keys}
        with single_process_quiet():
            dcp.load(flat, storage_reader=reader,
                     planner=DefaultLoadPlanner(allow_partial_load=True),
                     no_dist=not is_distributed())
    set_model_state_dict(model, {k: flat[prefix + k] for k in keys},
                         options=StateDictOptions(strict=strict))


def _saved_keys(reader: Reader) -> dict[str, None]:
    """The checkpoint's keys, read by the coordinator alone and shared (collective).

    A failure reaches every rank as its kind of error (sent encoded, so an error that
    does not pickle does too): none waits for the coordinator's answer.
    """
    return Collectives().on_coordinator(
        lambda: dict.fromkeys(reader.read_metadata().state_dict_metadata),
        f"reading the keys of {reader.backend.uri} on the coordinator failed")


def _tensor_keys(metadata: Metadata) -> list[tuple[str, TensorStorageMetadata]]:
    return [(k, md) for k, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)]


def _batches(items: list[tuple[str, TensorStorageMetadata]],
             budget: int) -> Iterator[list[tuple[str, TensorStorageMetadata]]]:
    batch: list[tuple[str, TensorStorageMetadata]] = []
    size = 0
    for key, md in items:
        nbytes = math.prod(md.size) * md.properties.dtype.itemsize
        if batch and size + nbytes > budget:
            yield batch
            batch, size = [], 0
        batch.append((key, md))
        size += nbytes
    if batch:
        yield batch


def _load_full(reader: Reader, batch: list[tuple[str, TensorStorageMetadata]]
               ) -> dict[str, torch.Tensor]:
    out = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype) for k, md in batch}
    with single_process_quiet():
        dcp.load(out, storage_reader=reader,
                 planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    return out


def export(uri: str, dest: str, format: Literal["torch", "safetensors"] = "torch", *,
           batch_bytes: int = 1 << 30, **options: Any) -> int:
    """Consolidate a sharded checkpoint into one file (run it in one process).

    Args:
        uri: The checkpoint.
        dest: Output file (local path, or any URI a backend serves).
        format: ``"torch"`` (a ``torch.save`` dict of full tensors and the non-tensor
            values) or ``"safetensors"`` (tensors only, streamed in batches).
        batch_bytes: Tensors are read in batches of about this many bytes (safetensors).
        **options: Reader/backend options.

    Returns:
        Bytes written.
    """
    if format not in ("torch", "safetensors"):
        raise ValueError(f"format must be 'torch' or 'safetensors', got {format!r}")
    dest_parsed = parse_uri(dest)
    dest_dir, _, name = dest_parsed.original.rstrip("/").rpartition("/")
    if dest_parsed.scheme == "file":
        dest_dir, name = os.path.split(dest_parsed.location)
    with _reader(uri, **options) as reader:
        return _export(reader, str(uri), dest_dir or ".", name, format, batch_bytes)


def _export(reader: Reader, uri: str, dest_dir: str, name: str, format: str,
            batch_bytes: int) -> int:
    metadata = reader.read_metadata()
    tensors = _tensor_keys(metadata)
    out_backend = open_backend(dest_dir)
    upload = out_backend.open_upload(name)
    written = 0
    try:
        if format == "torch":
            state: dict[str, Any] = _load_full(reader, tensors)
            others = [k for k in metadata.state_dict_metadata if k not in state]
            if others:
                objs: dict[str, Any] = dict.fromkeys(others)
                with single_process_quiet():
                    dcp.load(objs, storage_reader=reader,
                             planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
                state.update(objs)

            class _Sink:
                def write(self, b: Any) -> int:
                    nonlocal written
                    n = upload.write(b)
                    written += n
                    return n

                def flush(self) -> None:
                    pass

            torch.save(state, _Sink())  # type: ignore[arg-type]
        else:
            header: dict[str, Any] = {"__metadata__": {"format": "pt", "source": str(uri)}}
            offset = 0
            for key, md in tensors:
                dtype = md.properties.dtype
                if dtype not in _SAFETENSORS_DTYPES:
                    raise DcpstoreError(f"{key!r} has dtype {dtype}, which safetensors cannot "
                                        "store; export with format='torch'")
                nbytes = math.prod(md.size) * dtype.itemsize
                header[key] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(md.size),
                               "data_offsets": [offset, offset + nbytes]}
                offset += nbytes
            skipped = len(metadata.state_dict_metadata) - len(tensors)
            if skipped:
                logger.warning("safetensors holds tensors only: %d non-tensor entries skipped",
                               skipped)
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)
            upload.write(struct.pack("<Q", len(raw)))
            upload.write(raw)
            written = 8 + len(raw)
            for batch in _batches(tensors, batch_bytes):
                loaded = _load_full(reader, batch)
                for key, _md in batch:
                    t = loaded.pop(key).contiguous()
                    if t.numel():
                        written += upload.write(t.reshape(-1).view(torch.uint8).numpy().data)
        upload.commit()
    except BaseException:
        upload.abort()
        raise
    finally:
        out_backend.close()
    return written
