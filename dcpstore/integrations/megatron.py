"""Megatron-Core ``dist_checkpointing`` (``torch_dist``) on s3://, gs://, msc:// or local disk.

The one change is a feature flag, in the style of Megatron's own ``MultiStorageClientFeature``
(``megatron/core/msc_utils.py``): enable it once, before the first save or load,

>>> from dcpstore.integrations.megatron import DcpstoreFeature
>>> DcpstoreFeature.enable()
>>> dist_checkpointing.save(sharded_state_dict, "s3://bucket/run7/iter_0000100")
>>> dist_checkpointing.load(sharded_state_dict, "s3://bucket/run7/iter_0000100")

and Megatron's default ``torch_dist`` strategies keep their planners
(``MCoreSavePlanner`` / ``MCoreLoadPlanner``), their ``ShardedTensor`` translation, the
``common_state`` object and ``metadata.json``, with the storage going through dcpstore:

- the save strategy (``TorchDistSaveShardedStrategy.save`` / ``async_save``, whoever made
  the strategy) writes with ``dcpstore.save(..., overwrite=True)``: every rank streams its
  shards, the coordinator runs dcpstore's sharding guard and commits ``.metadata`` last, so a
  checkpoint is never torn, and a failed save leaves the previous one in place;
- the reader factory (``strategies.torch._get_filesystem_reader``, in every module that
  imported it) returns ``dcpstore.get_reader(checkpoint_dir)``;
- the small files Megatron writes and reads through ``maybe_msc`` (``metadata.json``, a
  legacy ``common.pt``, ``integrity.json``, the directory listing before a save) go through
  the store for a URI; local paths keep Megatron's own file I/O.

A URI whose scheme no dcpstore backend serves, or one that lost a slash (``s3:/b/x``), is
refused; nothing falls back to a local directory. :meth:`DcpstoreFeature.disable` restores
every patched attribute. Importing this module imports nothing of Megatron;
:meth:`~_DcpstoreFeatureFlag.enable` imports ``megatron.core.dist_checkpointing``.

On a machine without CUDA, Megatron's own ``torch_dist`` save fails at
``torch.cuda.synchronize()`` (``strategies/filesystem_async.py:248``); with the feature
enabled the save runs on the CPU, because dcpstore's writer does the I/O.
"""

from __future__ import annotations

import io
import logging
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import PurePath
from typing import Any

from dcpstore.errors import DcpstoreError
from dcpstore.integrations import store_files as files
from dcpstore.integrations.dcp_routing import check_uri

__all__ = ["DcpstoreFeature", "MegatronUnsupportedError", "routes"]

logger = logging.getLogger(__name__)

_TORCH = "megatron.core.dist_checkpointing.strategies.torch"
_MSC = "megatron.core.msc_utils"
_READER = "_get_filesystem_reader"


class MegatronUnsupportedError(DcpstoreError, RuntimeError):
    """The installed Megatron-Core lacks a hook point this integration patches."""


def _text(path: Any) -> str:
    """``path`` as a string; a ``pathlib`` path that Megatron made of a URI is repaired.

    ``Path("s3://b/x")`` is ``s3:/b/x``; Megatron wraps the directory in ``Path`` in a few
    read paths (``load_tensors_metadata``). A user's plain string is checked, not repaired.
    """
    text = os.fspath(path)
    if isinstance(path, PurePath) and ":/" in text and "://" not in text:
        scheme, _, rest = text.partition(":/")
        if scheme and "/" not in scheme and len(scheme) > 1:
            return f"{scheme}://{rest}"
    return text


def routes(path: Any) -> bool:
    """Whether ``path`` names a store location (a ``scheme://`` URI) that dcpstore serves.

    Local paths are not "routed" here (Megatron's own file I/O handles their small files);
    the save and load strategies use dcpstore for local paths too.

    Raises:
        MangledURIError: ``path`` is a URI that lost a slash.
        BackendNotFoundError: ``path`` is a URI whose scheme no installed backend serves.
    """
    return isinstance(path, str | os.PathLike) and files.is_store_uri(_text(path))


# -- the small files: maybe_msc.{Path, open, os, torch} for URIs ----------------------------


def _exists(uri: str) -> bool:
    """An object at ``uri``, or a "directory" (any object below it)."""
    parent, name = files.split(uri)
    with files.backend(parent) as store:
        return bool(store.exists(name) or store.list(f"{name}/"))


class _StorePath:
    """The part of ``pathlib.Path`` Megatron uses on a checkpoint directory, over a store."""

    def __init__(self, uri: str) -> None:
        self._uri = uri.rstrip("/")

    def __str__(self) -> str:
        return self._uri

    __fspath__ = __str__

    def __repr__(self) -> str:
        return f"_StorePath({self._uri!r})"

    def __truediv__(self, other: str) -> _StorePath:
        return _StorePath(f"{self._uri}/{other}")

    @property
    def name(self) -> str:
        return self._uri.rpartition("/")[2]

    def iterdir(self) -> Iterator[_StorePath]:
        names = sorted({key.partition("/")[0] for key in files.keys_under(self._uri)})
        return iter([self / name for name in names])

    def exists(self) -> bool:
        return _exists(self._uri)

    def is_dir(self) -> bool:
        return bool(files.keys_under(self._uri))

    def is_file(self) -> bool:
        return files.is_object(self._uri)

    def mkdir(self, *args: Any, **kwargs: Any) -> None:
        """Object stores have no directories: nothing to make."""


class _OsPath:
    def __init__(self, original: Any) -> None:
        self._original = original

    def exists(self, path: Any) -> bool:
        return _exists(_text(path)) if routes(path) else bool(self._original.exists(path))

    def isdir(self, path: Any) -> bool:
        if routes(path):
            return bool(files.keys_under(_text(path)))
        return bool(self._original.isdir(path))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._original, name)


class _Os:
    def __init__(self, original: Any) -> None:
        self._original = original
        self.path = _OsPath(original.path)

    def makedirs(self, path: Any, *args: Any, **kwargs: Any) -> None:
        if not routes(path):
            self._original.makedirs(path, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._original, name)


class _Torch:
    def __init__(self, original: Any) -> None:
        self._original = original

    def save(self, obj: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        if not routes(path):
            self._original.save(obj, path, *args, **kwargs)
            return
        buffer = io.BytesIO()
        self._original.save(obj, buffer, *args, **kwargs)
        with files.open_file(_text(path), "wb") as f:
            f.write(buffer.getvalue())

    def load(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        if not routes(path):
            return self._original.load(path, *args, **kwargs)
        return self._original.load(files.open_file(_text(path), "rb"), *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._original, name)


def _routed_getattr(original: Any) -> Any:
    """``MaybeMultiStorageClient.__getattr__`` that sends URIs dcpstore serves to the store."""

    def __getattr__(self: Any, name: str) -> Any:
        fallback = original(self, name)
        if name == "open":
            def open_(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
                if routes(path):
                    return files.open_file(_text(path), mode, *args, **kwargs)
                return fallback(path, mode, *args, **kwargs)
            return open_
        if name == "Path":
            def path_(path: Any, *args: Any) -> Any:
                if not args and routes(path):
                    return _StorePath(_text(path))
                return fallback(path, *args)
            return path_
        if name == "os":
            return _Os(fallback)
        if name == "torch":
            return _Torch(fallback)
        return fallback

    return __getattr__


def _routed_isdir(original: Any) -> Any:
    def path_isdir(self: Any, path: Any, strict: bool = True) -> bool:
        if routes(path):
            return bool(files.keys_under(_text(path)))
        return bool(original(self, path, strict=strict))

    return path_isdir


# -- the torch_dist strategies ---------------------------------------------------------------


def _routed_reader(original: Any) -> Any:
    def _get_filesystem_reader(checkpoint_dir: Any, cache_metadata: bool = False,
                               async_strategy: str = "mcore") -> Any:
        from dcpstore.dcp.api import get_reader

        text = _text(checkpoint_dir)
        check_uri(text)
        return get_reader(text)

    _get_filesystem_reader.__wrapped__ = original  # type: ignore[attr-defined]
    return _get_filesystem_reader


def _save_through_dcpstore(strategy: Any, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
    """What ``TorchDistSaveShardedStrategy.async_save`` plans, written by dcpstore."""
    import dcpstore

    torch_strategies = sys.modules[_TORCH]
    uri = _text(checkpoint_dir)
    check_uri(uri)
    sharded_state_dict, _flat, _renames = (
        torch_strategies._replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, strategy.keep_only_main_replica))
    pyt_state_dict = torch_strategies.mcore_to_pyt_state_dict(sharded_state_dict, False)
    planner = torch_strategies.MCoreSavePlanner(
        dedup_replicated_tensors=not strategy.keep_only_main_replica,
        flatten_state_dict=False,
        flatten_sharded_tensors=False,
    )
    # Megatron overwrites an existing directory ("Overwriting old incomplete / corrupted
    # checkpoint..."); dcpstore's overwrite keeps the old one until the new one commits
    dcpstore.save(pyt_state_dict, uri, planner=planner, overwrite=True)


def _routed_save(original: Any) -> Any:
    def save(self: Any, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
        _save_through_dcpstore(self, sharded_state_dict, checkpoint_dir)

    save.__wrapped__ = original  # type: ignore[attr-defined]
    return save


_warned_async = False


def _routed_async_save(original: Any) -> Any:
    def async_save(self: Any, sharded_state_dict: Any, checkpoint_dir: Any,
                   async_strategy: str = "nvrx") -> Any:
        global _warned_async
        if not _warned_async:
            _warned_async = True
            logger.warning(
                "DcpstoreFeature: async_save writes and commits the checkpoint before it "
                "returns (dcpstore writes synchronously under Megatron's async API); the "
                "returned AsyncRequest has no background work left"
            )
        _save_through_dcpstore(self, sharded_state_dict, checkpoint_dir)
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

        return AsyncRequest(None, (), [])

    async_save.__wrapped__ = original  # type: ignore[attr-defined]
    return async_save


# -- the flag ----------------------------------------------------------------------------------


class _DcpstoreFeatureFlag:
    """A feature flag like Megatron's ``MultiStorageClientFeature``: while it is enabled,
    Megatron-Core's ``torch_dist`` checkpoints go through dcpstore (see the module's docs).
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        # (owner, attribute name, original value) for every patched attribute
        self._patches: list[tuple[Any, str, Any]] = []
        self._reader: tuple[Any, Any] | None = None  # (Megatron's reader factory, ours)

    def is_enabled(self) -> bool:
        """Whether Megatron's checkpoint I/O goes through dcpstore now."""
        return bool(self._patches)

    def enable(self) -> None:
        """Route Megatron-Core's ``torch_dist`` save/load and checkpoint files to dcpstore.

        Idempotent. Imports ``megatron.core.dist_checkpointing``.

        Raises:
            MegatronUnsupportedError: The installed Megatron-Core lacks a hook point
                (the error names it and the installed version).
        """
        with self._lock:
            if self._patches:
                return
            import importlib

            try:
                torch_strategies = importlib.import_module(_TORCH)
                msc_utils = importlib.import_module(_MSC)
                importlib.import_module("megatron.core.dist_checkpointing.serialization")
            except ImportError as exc:
                raise MegatronUnsupportedError(
                    f"cannot import Megatron-Core's dist_checkpointing: {exc}. Install "
                    "megatron-core (tested: 0.19.2; see docs/integrations/megatron.md)"
                ) from exc
            strategy = getattr(torch_strategies, "TorchDistSaveShardedStrategy", None)
            maybe = getattr(msc_utils, "MaybeMultiStorageClient", None)
            reader = getattr(torch_strategies, _READER, None)
            needed = {
                f"{_TORCH}.TorchDistSaveShardedStrategy.save": getattr(strategy, "save", None),
                f"{_TORCH}.TorchDistSaveShardedStrategy.async_save":
                    getattr(strategy, "async_save", None),
                f"{_TORCH}.{_READER}": reader,
                f"{_TORCH}.mcore_to_pyt_state_dict":
                    getattr(torch_strategies, "mcore_to_pyt_state_dict", None),
                f"{_TORCH}._replace_state_dict_keys_with_sharded_keys":
                    getattr(torch_strategies, "_replace_state_dict_keys_with_sharded_keys", None),
                f"{_TORCH}.MCoreSavePlanner": getattr(torch_strategies, "MCoreSavePlanner", None),
                f"{_MSC}.MaybeMultiStorageClient.__getattr__": getattr(maybe, "__getattr__",
                                                                       None),
                f"{_MSC}.MaybeMultiStorageClient.path_isdir": getattr(maybe, "path_isdir",
                                                                      None),
            }
            missing = [name for name, value in needed.items() if value is None]
            if missing:
                raise MegatronUnsupportedError(
                    f"megatron-core {_megatron_version()} lacks {', '.join(missing)}; "
                    "DcpstoreFeature knows megatron-core 0.19. Pass "
                    "storage_writer=dcpstore.get_writer(dir) / "
                    "dcpstore.get_reader(dir) to torch.distributed.checkpoint instead"
                )
            patches: list[tuple[Any, str, Any]] = [
                (strategy, "save", _routed_save(strategy.__dict__["save"])),
                (strategy, "async_save", _routed_async_save(strategy.__dict__["async_save"])),
                (maybe, "__getattr__", _routed_getattr(maybe.__dict__["__getattr__"])),
                (maybe, "path_isdir", _routed_isdir(maybe.__dict__["path_isdir"])),
            ]
            routed_reader = _routed_reader(reader)
            self._reader = (reader, routed_reader)
            for name, module in list(sys.modules.items()):
                if (name.startswith("megatron.") and module is not None
                        and module.__dict__.get(_READER) is reader):
                    patches.append((module, _READER, routed_reader))
            for owner, attr, value in patches:
                self._patches.append((owner, attr, getattr(owner, attr)))
                setattr(owner, attr, value)
            logger.info("DcpstoreFeature enabled: Megatron-Core torch_dist checkpoints go "
                        "through dcpstore (%d hook points)", len(patches))

    def disable(self) -> None:
        """Restore every attribute :meth:`enable` patched. Idempotent."""
        with self._lock:
            while self._patches:
                owner, attr, original = self._patches.pop()
                setattr(owner, attr, original)
            if self._reader is not None:
                # modules imported while enabled bound our reader factory by name
                original, routed = self._reader
                for name, module in list(sys.modules.items()):
                    if (name.startswith("megatron.") and module is not None
                            and module.__dict__.get(_READER) is routed):
                        setattr(module, _READER, original)
                self._reader = None

    def __getstate__(self) -> dict[str, Any]:
        return {"enabled": self.is_enabled()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        if state.get("enabled"):
            self.enable()


def _megatron_version() -> str:
    try:
        from importlib.metadata import version

        return version("megatron-core")
    except Exception:
        return "(unknown version)"


#: The flag: ``DcpstoreFeature.enable()`` / ``.disable()`` / ``.is_enabled()``.
DcpstoreFeature = _DcpstoreFeatureFlag()
