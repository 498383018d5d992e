"""Names of the objects in a checkpoint (DCP's layout, plus a per-save id).

::

    .metadata                          the commit point (pickled DCP Metadata)
    .dcpstore-<save>.json              integrity manifest of save <save>
    __<rank>_<n>.<save>.distcp         data files of save <save>

torch's ``FileSystemWriter`` names data files ``__<rank>_<n>.distcp``; dcpstore adds
the save id so a new save never writes over files an existing ``.metadata`` points to.
Readers follow ``_StorageInfo.relative_path``, so both load with either reader.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from dcpstore.dcp.manifest import SAVE_ID_PREFIX, manifest_key
from dcpstore.errors import IntegrityError

__all__ = [
    "METADATA_KEY",
    "data_file_name",
    "is_checkpoint_object",
    "manifest_key",
    "new_save_id",
    "save_id_of",
    "save_id_of_metadata",
]

METADATA_KEY = ".metadata"
DATA_SUFFIX = ".distcp"

_DATA_RE = re.compile(r"^__\d+_\d+(?:\.(?P<save>[0-9a-f]{8,32}))?\.distcp$")
_MANIFEST_RE = re.compile(r"^\.dcpstore-(?P<save>[0-9a-f]{8,32})\.json$")


def new_save_id() -> str:
    """A fresh save id, as recorded in ``storage_meta.save_id``."""
    return SAVE_ID_PREFIX + uuid.uuid4().hex[:16]


def data_file_name(rank: int, index: int, save_id: str) -> str:
    """Name of data file ``index`` of ``rank`` in save ``save_id``."""
    return f"__{rank}_{index}.{save_id.removeprefix(SAVE_ID_PREFIX)}{DATA_SUFFIX}"


def save_id_of(key: str) -> str | None:
    """The save id encoded in a data file or manifest name (``None`` if it has none)."""
    name = key.rsplit("/", 1)[-1]
    m = _DATA_RE.match(name) or _MANIFEST_RE.match(name)
    if m is None or not m.group("save"):
        return None
    return SAVE_ID_PREFIX + m.group("save")


def save_id_of_metadata(metadata: Any, *, source: str = ".metadata") -> str | None:
    """The dcpstore save id a DCP ``Metadata`` names (``None``: another writer's).

    Raises:
        IntegrityError: Its data files carry a dcpstore save id but ``storage_meta`` does
            not name one: it was damaged, and skipping the manifest would load unverified.
    """
    save_id = getattr(getattr(metadata, "storage_meta", None), "save_id", None)
    if isinstance(save_id, str) and save_id.startswith(SAVE_ID_PREFIX):
        return save_id
    paths = {getattr(i, "relative_path", "") for i in (getattr(metadata, "storage_data", None)
                                                        or {}).values()}
    written = sorted({s for s in map(save_id_of, paths) if s is not None})
    if written:
        raise IntegrityError(
            f"{source} is damaged: its data files belong to dcpstore save {written[0]}, but "
            f"it names save id {save_id!r}, so its integrity manifest cannot be found; "
            "restore it or load an older checkpoint"
        )
    return None


def is_checkpoint_object(key: str) -> bool:
    """Whether ``key`` (directly under a checkpoint root) belongs to a checkpoint."""
    name = key.rsplit("/", 1)[-1]
    return (
        name == METADATA_KEY
        or bool(_DATA_RE.match(name))
        or bool(_MANIFEST_RE.match(name))
        or (name.endswith(".tmp") and ".metadata." in name)  # an interrupted atomic put
    )
