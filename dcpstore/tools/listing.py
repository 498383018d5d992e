"""Finding and describing checkpoints: ``dcpstore ls`` and ``dcpstore inspect``.

:func:`list_checkpoints` reads one listing of a root (and, per committed checkpoint, its
manifest, never its ``.metadata`` pickle: ``dcpstore ls`` imports no torch);
:func:`inspect_checkpoint` unpickles one checkpoint's ``.metadata`` for its keys,
dtypes, shapes and sharding. Re-exported by :mod:`dcpstore.tools.ops`.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from dcpstore.dcp import layout
from dcpstore.dcp.checksum import crc32c
from dcpstore.dcp.manifest import Manifest
from dcpstore.dcp.metadata_io import check_references, load_metadata, read_manifest
from dcpstore.dcp.references import RETIRED_KEY
from dcpstore.errors import DcpstoreError, IntegrityError
from dcpstore.storage.backend import Backend, ObjectInfo
from dcpstore.storage.resolve import open_backend
from dcpstore.storage.uri import is_reference

__all__ = [
    "CheckpointInfo",
    "group_by_dir",
    "inspect_checkpoint",
    "list_checkpoints",
    "list_checkpoints_tiered",
]

logger = logging.getLogger("dcpstore.tools.ops")  # where the tools always logged

_STEP_RE = re.compile(r"(?:^|/)step-(\d+)$")
_RANK_RE = re.compile(r"^__(\d+)_")


@dataclass
class CheckpointInfo:
    """One checkpoint (or incomplete save) found under a root."""

    path: str
    committed: bool
    size: int
    files: int
    mtime: float | None
    step: int | None = None
    world_size: int | None = None
    #: With a local tier: where it is committed (``local``, ``remote``, ``both``).
    where: str | None = None
    #: A deleted step whose data files later (incremental) steps still reference.
    retired: bool = False


def group_by_dir(objects: Iterable[ObjectInfo]) -> dict[str, list[ObjectInfo]]:
    """The checkpoint objects of a listing, by directory (``""``: the root); other
    objects are left out."""
    groups: dict[str, list[ObjectInfo]] = {}
    for obj in objects:
        head, _, name = obj.key.rpartition("/")
        if layout.is_checkpoint_object(name):
            groups.setdefault(head, []).append(obj)
    return groups


def list_checkpoints(root_uri: str, **options: Any) -> list[CheckpointInfo]:
    """Checkpoints (committed or incomplete) under ``root_uri``, one listing."""
    root = open_backend(root_uri, **options)
    out = []
    listing = root.list()
    retired = {o.key.rpartition("/")[0] for o in listing
               if o.key.rpartition("/")[2] == RETIRED_KEY}
    for head, objs in sorted(group_by_dir(listing).items()):
        committed = any(o.key.endswith(layout.METADATA_KEY) and
                        o.key.rpartition("/")[2] == layout.METADATA_KEY for o in objs)
        m = _STEP_RE.search(head)
        info = CheckpointInfo(
            path=head or ".",
            committed=committed,
            size=sum(o.size for o in objs),
            files=sum(o.key.endswith(".distcp") for o in objs),
            mtime=max((o.mtime for o in objs if o.mtime is not None), default=None),
            step=int(m.group(1)) if m else None,
            retired=head in retired and not committed,
        )
        if committed:
            ckpt = root.child(head) if head else root
            try:
                info.world_size = _world_size(ckpt, objs)
            except Exception as exc:  # listing must not fail on one damaged checkpoint
                logger.warning("%s: %s", head, exc)
        out.append(info)
    root.close()
    return out


def _world_size(ckpt: Backend, objs: list[ObjectInfo]) -> int | None:
    """The world size the manifest of a committed checkpoint records (``None``: another
    writer's checkpoint, which has none).

    The manifest is found as the one that records the size and CRC32C of the
    ``.metadata`` beside it, so ``.metadata`` is not unpickled, which would import torch
    (``dcpstore ls`` does not); only manifests older than that record fall back to the
    save id ``.metadata`` names.
    """
    names = sorted(name for name in (o.key.rpartition("/")[2] for o in objs)
                   if name.endswith(".json") and layout.save_id_of(name) is not None)
    if not names:
        return None
    raw = ckpt.get(layout.METADATA_KEY)
    digest = (len(raw), crc32c(raw))
    unrecorded = False
    for name in names:  # normally one; more while an overwrite or a failed save is there
        try:
            manifest = Manifest.from_bytes(ckpt.get(name), source=f"{ckpt.uri}/{name}")
        except (OSError, ValueError, DcpstoreError) as exc:  # another save's, damaged
            logger.debug("%s: %s", name, exc)
            continue
        if manifest.metadata is None:
            unrecorded = True
        elif (manifest.metadata.size, manifest.metadata.crc32c) == digest:
            return manifest.world_size
    if not unrecorded:
        raise IntegrityError(f"{ckpt.uri}/{layout.METADATA_KEY}: no manifest beside it "
                             "records it (`dcpstore verify` tells more)")
    save_id = getattr(load_metadata(ckpt)[0].storage_meta, "save_id", None)
    named = read_manifest(ckpt, save_id)
    return named.world_size if named else None


def list_checkpoints_tiered(root_uri: str, local_tier: str, **options: Any
                            ) -> list[CheckpointInfo]:
    """:func:`list_checkpoints` of a Checkpointer's root and its local tier, merged:
    ``where`` says whether each step is committed ``local``, ``remote`` or ``both``."""
    merged: dict[str, CheckpointInfo] = {}
    for info in list_checkpoints(root_uri, **options):
        info.where = "remote"
        merged[info.path] = info
    for info in list_checkpoints(local_tier):
        info.where = "local"
        known = merged.get(info.path)
        if known is None or (info.committed and not known.committed):
            merged[info.path] = info
        elif info.committed and known.committed:
            known.where = "both"
    return [merged[k] for k in sorted(merged)]


def inspect_checkpoint(uri: str, **options: Any) -> dict[str, Any]:
    """Keys, dtypes, shapes, sharding, files and versions of one checkpoint."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    backend = open_backend(uri, **options)
    md = load_metadata(backend)[0]
    manifest = read_manifest(backend, getattr(md.storage_meta, "save_id", None))
    check_references(md, manifest, source=f"{backend.uri}/.metadata")
    ranks_by_key: dict[str, set[int]] = {}
    referenced = 0
    for index, info in (md.storage_data or {}).items():
        if is_reference(info.relative_path):
            referenced += info.length
        m = _RANK_RE.match(info.relative_path.rpartition("/")[2])
        if m:
            ranks_by_key.setdefault(index.fqn, set()).add(int(m.group(1)))
    keys = []
    total = 0
    for fqn, item in sorted(md.state_dict_metadata.items()):
        if isinstance(item, TensorStorageMetadata):
            nbytes = math.prod(item.size) * item.properties.dtype.itemsize
            total += nbytes
            keys.append({"key": fqn, "kind": "tensor", "dtype": str(item.properties.dtype)
                         .removeprefix("torch."), "shape": list(item.size), "bytes": nbytes,
                         "chunks": len(item.chunks), "ranks": len(ranks_by_key.get(fqn, ()))})
        else:
            keys.append({"key": fqn, "kind": "object", "dtype": None, "shape": None,
                         "bytes": None, "chunks": 1, "ranks": len(ranks_by_key.get(fqn, ()))})
    files = ({k: v.size for k, v in sorted(manifest.files.items())} if manifest else
             {o.key: o.size for o in backend.list("__")
              if o.key in {i.relative_path for i in (md.storage_data or {}).values()}})
    backend.close()
    return {
        "uri": uri,
        "save_id": getattr(md.storage_meta, "save_id", None),
        "world_size": manifest.world_size if manifest else len(
            {r for rs in ranks_by_key.values() for r in rs}),
        "dcpstore_version": manifest.dcpstore_version if manifest else None,
        "torch_version": manifest.torch_version if manifest else None,
        "created": manifest.created if manifest else None,
        "tensor_bytes": total,
        "stored_bytes": sum(files.values()),
        # an incremental checkpoint: bytes its items read from sibling steps
        "referenced_bytes": referenced,
        "referenced_files": ({k: v.size for k, v in sorted(manifest.references.items())}
                             if manifest else {}),
        "keys": keys,
        "files": files,
        "verified_by_manifest": manifest is not None,
    }
