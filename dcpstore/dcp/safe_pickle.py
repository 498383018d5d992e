"""A restricted unpickler for DCP's ``.metadata``.

``.metadata`` is a pickle. torch's readers ``pickle.load`` it unrestricted, so a
checkpoint from an untrusted bucket can run code on load. dcpstore admits only the
classes a DCP ``Metadata`` is made of (DCP's metadata dataclasses, ``_StorageInfo``,
torch dtypes/layouts/memory formats, ``torch.Size``, a few std value types) and refuses
everything else before it is imported or called.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from dcpstore.errors import UnsafeCheckpointError

__all__ = ["safe_loads"]

_ALLOWED: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "builtins": {"set", "frozenset", "slice", "complex"},
}


#: Path classes of ``FileSystemWriter`` subclasses, which DCP pickles into
#: ``storage_meta.checkpoint_id``. They are never imported: :class:`_ForeignPath` takes
#: their state instead (e.g. checkpoints written by multi-storage-client's
#: ``MultiStorageFileSystemWriter``).
_FOREIGN_PATHS = {("multistorageclient.pathlib", "MultiStoragePath")}


class _ForeignPath:
    """Inert stand-in for another library's path object found in ``.metadata``."""

    path: str = ""

    def __setstate__(self, state: Any) -> None:
        value = state.get("_path", "") if isinstance(state, dict) else state
        self.path = str(value)

    def __fspath__(self) -> str:
        return self.path

    def __str__(self) -> str:
        return self.path

    def __repr__(self) -> str:
        return f"ForeignPath({self.path!r})"


def _is_torch_constant(module: str, name: str) -> bool:
    if module != "torch":
        return False
    value = getattr(torch, name, None)
    return isinstance(value, (torch.dtype, torch.layout, torch.memory_format))


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, source: str) -> None:
        super().__init__(io.BytesIO(data))
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()) or _is_torch_constant(module, name):
            return super().find_class(module, name)
        if (module, name) in _FOREIGN_PATHS:
            return _ForeignPath
        raise UnsafeCheckpointError(
            f"{self._source} references {module}.{name}, which a DCP .metadata never "
            "needs; refusing to load it (it could run code). If you wrote this "
            "checkpoint with a custom planner and trust its source, pass "
            "allow_unsafe_metadata=True."
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self._source} uses persistent ids; refusing it")


def safe_loads(data: bytes, *, source: str = ".metadata", trusted: bool = False) -> Any:
    """Unpickle ``data`` admitting only DCP metadata types.

    Args:
        data: The pickle.
        source: Name used in error messages.
        trusted: Skip the restriction (explicit opt-in for custom metadata classes).

    Raises:
        UnsafeCheckpointError: The pickle references anything outside the allow-list.
        pickle.UnpicklingError: The data is not a valid pickle.
    """
    if trusted:
        return pickle.loads(data)
    return _RestrictedUnpickler(data, source).load()
