"""HF Accelerate: ``save_state`` / ``load_state`` of FSDP2 sharded checkpoints through dcpstore.

Accelerate 1.15's ``fsdp_utils`` hard-code ``FileSystemWriter(dir)`` / ``FileSystemReader(dir)``
and every other part of a checkpoint goes through ``os.makedirs``, ``pathlib`` and
``shutil.rmtree``; an ``s3://`` directory ends up as a local tree named ``s3:``. The user's
change here is one class:

>>> from dcpstore.integrations.accelerate import DcpstoreAccelerator
>>> accelerator = DcpstoreAccelerator(fsdp_plugin=plugin)      # instead of Accelerator(...)
>>> accelerator.save_state("s3://bucket/run7/step-100")
>>> accelerator.load_state("s3://bucket/run7/step-100")

How a save works:

- the model and optimizer shards (FSDP2, ``SHARDED_STATE_DICT``) stream through
  ``dcpstore.get_writer`` into ``<dir>/pytorch_model_fsdp_<i>`` and ``<dir>/optimizer_<i>``,
  the directory names Accelerate uses, in DCP's own layout;
- everything else Accelerate (or a save hook) writes (scheduler, sampler, scaler, RNG states,
  custom objects) is written by Accelerate's own code into a private scratch directory and
  then stored with the backend's ``put``;
- when every rank succeeded, the main process puts a commit marker
  (:data:`COMMIT_MARKER`). A directory without it is not a checkpoint: ``load_state`` refuses
  it and "latest" never names it;
- with ``ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=N)`` the
  ``checkpoints/checkpoint_<n>`` directories live on the store, and the oldest committed ones
  beyond ``N`` are deleted through the backend only after the new one committed.

Local paths go through dcpstore too (its local backend), so a local checkpoint has the same
commit marker and integrity manifests; its DCP directories still load with torch's
``FileSystemReader`` and stock Accelerate.

The integration swaps Accelerate's four ``fsdp_utils`` save/load functions in the
``accelerate.accelerator`` (and ``transformers.trainer``) module namespaces for the
duration of one ``save_state`` / ``load_state`` call. It checks the installed version and
those names first and refuses with :class:`UnsupportedVersionError` where they differ.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

try:
    import accelerate.accelerator
    from accelerate import Accelerator
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("dcpstore.integrations.accelerate needs HF Accelerate: "
                      "pip install accelerate") from exc

import dcpstore
from dcpstore.errors import (
    CheckpointNotFoundError,
    DcpstoreError,
    IncompleteCheckpointError,
    InvalidURIError,
)
from dcpstore.storage.backend import Backend

__all__ = [
    "COMMIT_MARKER",
    "SUPPORTED_ACCELERATE",
    "DcpstoreAccelerator",
    "UnsupportedVersionError",
    "check_uri",
    "is_committed",
    "join_uri",
    "latest_checkpoint",
    "list_checkpoints",
]

logger = logging.getLogger(__name__)

#: Object put last, by the main process, when every part of a checkpoint is stored.
COMMIT_MARKER = "dcpstore_checkpoint.json"
#: Accelerate releases whose internals this module was checked against: ``[low, high)``.
SUPPORTED_ACCELERATE = ((1, 10), (1, 16))

_FSDP_FUNCTIONS = ("save_fsdp_model", "load_fsdp_model", "save_fsdp_optimizer",
                   "load_fsdp_optimizer")
_FSDP_HELPERS = ("_prepare_sd_options", "_get_model_state_dict", "_set_model_state_dict")
_REMOTE_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs", "msc"})
_SWAP_LOCK = threading.RLock()


class UnsupportedVersionError(DcpstoreError, RuntimeError):
    """The installed trainer's internals differ from those this integration adapts."""


# -- URIs ---------------------------------------------------------------------------------


def _schemes() -> frozenset[str]:
    return _REMOTE_SCHEMES | {s for s in dcpstore.available_backends() if s != "file"}


def check_uri(uri: str | os.PathLike[str]) -> str:
    """Return ``uri`` as a string, refusing one whose ``scheme://`` was collapsed.

    ``os.path.join`` / ``pathlib`` turn ``s3://b/x`` into ``s3:/b/x``; handed to a local
    file API that becomes a directory named ``s3:``. Such a string is an error here.

    Raises:
        dcpstore.InvalidURIError: ``uri`` is ``scheme:/...`` (or ``scheme:`` alone) for a
            scheme dcpstore serves.
    """
    text = os.fspath(uri)
    match = re.match(r"^(?:\./)?([A-Za-z][A-Za-z0-9+.-]*):(/?)(?!/)", text)
    if match and match.group(1).lower() in _schemes() and not text.startswith(
            f"{match.group(1)}://"):
        raise InvalidURIError(
            f"{text!r} looks like a {match.group(1)}:// URI whose '//' was collapsed (by "
            f"os.path or pathlib); it would become a local directory named "
            f"'{match.group(1)}:'. Pass the URI as a string, e.g. "
            f"'{match.group(1)}://bucket/prefix'.")
    return text


def join_uri(root: str | os.PathLike[str], *parts: str) -> str:
    """Join key segments onto a URI or local path, keeping ``scheme://`` and ``?query``."""
    text = check_uri(root)
    base, sep, query = text.partition("?")
    for part in parts:
        base = base.rstrip("/") + "/" + part.strip("/") if base else part
    return base + sep + query


def is_remote(uri: str) -> bool:
    """Whether ``uri`` names an object store rather than a local path."""
    scheme, sep, _ = uri.partition("://")
    return bool(sep) and scheme.lower() != "file"


def _delete_tree(uri: str) -> None:
    """Delete every object under ``uri`` through its backend (and, for a local path, the
    directories left empty)."""
    store = dcpstore.open_backend(uri)
    store.delete([COMMIT_MARKER])  # first: a crash mid-delete leaves no committed remnant
    store.delete(info.key for info in store.list())
    if not is_remote(uri):
        path = uri.split("?", 1)[0].removeprefix("file://")
        for dirpath, _, _ in sorted(os.walk(path), key=lambda w: -len(w[0])):
            with contextlib.suppress(OSError):  # not empty: something else lives there
                os.rmdir(dirpath)


def _is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _all_ok(ok: bool, error: BaseException | None) -> None:
    """Collective: raise on every rank if any rank failed (the first failure is named)."""
    if not _is_dist():
        if error is not None:
            raise error
        return
    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, (ok, None if error is None else repr(error)))
    failed = [(rank, msg) for rank, (good, msg) in enumerate(flags) if not good]
    if error is not None:
        raise error
    if failed:
        rank, msg = failed[0]
        raise DcpstoreError(f"checkpoint save failed on rank {rank}: {msg}; nothing was "
                            "committed")


def _barrier() -> None:
    if _is_dist():
        dist.barrier()


# -- committed checkpoints on a store ---------------------------------------------------------


def is_committed(checkpoint_uri: str | os.PathLike[str]) -> bool:
    """Whether ``checkpoint_uri`` holds a checkpoint whose commit marker is stored."""
    return dcpstore.open_backend(check_uri(checkpoint_uri)).exists(COMMIT_MARKER)


def list_checkpoints(root_uri: str | os.PathLike[str], prefix: str,
                     *, committed: bool | None = True) -> list[tuple[int, str]]:
    """``(number, uri)`` of each ``<prefix><number>`` directory under ``root_uri``, oldest first.

    Args:
        root_uri: The directory holding the checkpoints (a URI or a local path).
        prefix: Directory name before the number (``"checkpoint_"``, ``"checkpoint-"``).
        committed: ``True``: only committed ones; ``False``: only uncommitted ones;
            ``None``: all.
    """
    root = dcpstore.open_backend(check_uri(root_uri))
    numbers: dict[int, bool] = {}
    pattern = re.compile(re.escape(prefix) + r"(\d+)/(.*)$")
    for info in root.list(prefix):
        match = pattern.match(info.key)
        if match:
            number = int(match.group(1))
            numbers[number] = numbers.get(number, False) or match.group(2) == COMMIT_MARKER
    return [(n, join_uri(root_uri, f"{prefix}{n}")) for n in sorted(numbers)
            if committed is None or numbers[n] == committed]


def latest_checkpoint(root_uri: str | os.PathLike[str], prefix: str) -> str | None:
    """URI of the newest committed ``<prefix><number>`` under ``root_uri``, or ``None``."""
    found = list_checkpoints(root_uri, prefix)
    return found[-1][1] if found else None


def rotate(root_uri: str, prefix: str, keep: int, protect: Sequence[str] = ()) -> None:
    """Keep the newest ``keep`` committed checkpoints; delete older ones and older leftovers.

    Runs on one process, after the newest checkpoint committed. A checkpoint's marker is
    deleted first, so a crash mid-delete leaves an uncommitted leftover, never a torn
    checkpoint that "latest" could name.
    """
    committed = list_checkpoints(root_uri, prefix)
    if not committed:
        return
    newest = committed[-1][0]
    protected = {check_uri(p).rstrip("/") for p in protect}
    doomed = [uri for _, uri in committed[:max(len(committed) - keep, 0)]
              if uri.rstrip("/") not in protected]
    doomed += [uri for n, uri in list_checkpoints(root_uri, prefix, committed=False)
               if n < newest]
    for uri in doomed:
        logger.info("deleting old checkpoint %s", uri)
        _delete_tree(uri)


# -- moving a scratch directory's files to and from a store ------------------------------------


def _upload_tree(local_dir: str, store: Backend) -> list[str]:
    keys = []
    for dirpath, _, files in os.walk(local_dir):
        for name in sorted(files):
            path = os.path.join(dirpath, name)
            key = os.path.relpath(path, local_dir).replace(os.sep, "/")
            with open(path, "rb") as f:
                store.put(key, f.read())
            keys.append(key)
    return keys


def download_extras(store: Backend, local_dir: str, skip_dirs: Sequence[str]) -> None:
    """Fetch every object not under a DCP directory (``skip_dirs`` prefixes) into ``local_dir``."""
    for info in store.list():
        top = info.key.split("/", 1)[0]
        if "/" in info.key and any(top.startswith(p) for p in skip_dirs):
            os.makedirs(os.path.join(local_dir, top), exist_ok=True)  # listing probes see it
            continue
        if info.key == COMMIT_MARKER or info.key.startswith(".dcpstore"):
            continue
        path = os.path.join(local_dir, *info.key.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(store.get(info.key))


def _commit(store: Backend, kind: str, extra: dict[str, Any] | None = None) -> None:
    marker = {"format": kind, "dcpstore": dcpstore.__version__, "torch": torch.__version__,
              "world_size": dist.get_world_size() if _is_dist() else 1, **(extra or {})}
    store.put(COMMIT_MARKER, json.dumps(marker, indent=1).encode(), atomic=True)


def require_committed(checkpoint_uri: str) -> Backend:
    """The checkpoint's backend; raise unless its commit marker is stored."""
    store = dcpstore.open_backend(checkpoint_uri)
    if store.exists(COMMIT_MARKER):
        return store
    if store.list():
        raise IncompleteCheckpointError(
            f"{checkpoint_uri} has no {COMMIT_MARKER}: its save did not finish (it is not a "
            "checkpoint). Load an earlier one; `dcpstore gc` removes leftovers.")
    raise CheckpointNotFoundError(f"no checkpoint at {checkpoint_uri}")


# -- Accelerate's fsdp_utils, redirected -----------------------------------------------------


def _version_tuple(text: str) -> tuple[int, int]:
    parts = re.findall(r"\d+", text)[:2]
    return (int(parts[0]), int(parts[1])) if len(parts) == 2 else (0, 0)


def check_accelerate() -> ModuleType:
    """Import ``accelerate.utils.fsdp_utils`` and check the internals this module adapts.

    Raises:
        UnsupportedVersionError: the version is outside :data:`SUPPORTED_ACCELERATE` or a
            function this module swaps is missing.
    """
    import accelerate
    import accelerate.accelerator
    from accelerate.utils import fsdp_utils

    low, high = SUPPORTED_ACCELERATE
    version = _version_tuple(accelerate.__version__)
    missing = [n for n in _FSDP_HELPERS + _FSDP_FUNCTIONS if not hasattr(fsdp_utils, n)]
    missing += [f"accelerate.accelerator.{n}" for n in _FSDP_FUNCTIONS
                if not hasattr(accelerate.accelerator, n)]
    if not low <= version < high or missing:
        raise UnsupportedVersionError(
            f"dcpstore's Accelerate integration supports accelerate "
            f"{low[0]}.{low[1]}-{high[0]}.{high[1] - 1}.x; found {accelerate.__version__}"
            + (f" without {', '.join(missing)}" if missing else "")
            + ". Install a supported accelerate (see requirements/constraints.txt) or use "
            "dcpstore.get_writer/get_reader with dcp.save/dcp.load directly.")
    return fsdp_utils


@dataclass
class _Redirect:
    """Maps a local scratch directory to the checkpoint URI its DCP parts go to."""

    scratch: str
    target: str

    def uri_for(self, directory: str | os.PathLike[str]) -> str | None:
        path = os.path.abspath(os.fspath(directory))
        rel = os.path.relpath(path, self.scratch)
        if rel == os.curdir:
            return self.target
        if rel.startswith(os.pardir):
            return None
        return join_uri(self.target, *rel.split(os.sep))


def _sharded_dcp(fsdp_plugin: Any, use_dcp: bool) -> bool:
    from torch.distributed.fsdp.fully_sharded_data_parallel import StateDictType

    if fsdp_plugin.state_dict_type != StateDictType.SHARDED_STATE_DICT or not use_dcp:
        return False
    if fsdp_plugin.fsdp_version != 2:
        raise UnsupportedVersionError(
            "dcpstore's Accelerate integration streams FSDP2 sharded state; this plugin has "
            f"fsdp_version={fsdp_plugin.fsdp_version}. Use FullyShardedDataParallelPlugin("
            "fsdp_version=2, state_dict_type='SHARDED_STATE_DICT').")
    return True


def _sub(uri: str, name: str, index: int) -> str:
    # the fsdp_utils load functions accept the DCP directory itself as input_dir
    leaf = f"{name}_{index}"
    return uri if uri.rstrip("/").rsplit("/", 1)[-1] == leaf else join_uri(uri, leaf)


def _make_replacements(redirect: _Redirect, fsdp_utils: ModuleType
                       ) -> dict[str, Callable[..., Any]]:
    from accelerate.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME

    originals = {name: getattr(fsdp_utils, name) for name in _FSDP_FUNCTIONS}

    def save_fsdp_model(fsdp_plugin: Any, accelerator: Any, model: Any, output_dir: str,
                        model_index: int = 0, adapter_only: bool = False,
                        use_dcp: bool = True) -> None:
        uri = redirect.uri_for(output_dir)
        if uri is None or not _sharded_dcp(fsdp_plugin, use_dcp):
            return originals["save_fsdp_model"](fsdp_plugin, accelerator, model, output_dir,
                                                model_index, adapter_only, use_dcp)
        os.makedirs(output_dir, exist_ok=True)  # the local stand-in, as the stock code does
        options = fsdp_utils._prepare_sd_options(fsdp_plugin)
        state = fsdp_utils._get_model_state_dict(model, adapter_only=adapter_only,
                                                 sd_options=options)
        dcp.save({"model": state}, storage_writer=dcpstore.get_writer(
            _sub(uri, FSDP_MODEL_NAME, model_index), overwrite=True))
        return None

    def load_fsdp_model(fsdp_plugin: Any, accelerator: Any, model: Any, input_dir: str,
                        model_index: int = 0, adapter_only: bool = False,
                        use_dcp: bool = True) -> Any:
        uri = redirect.uri_for(input_dir)
        if uri is None or not _sharded_dcp(fsdp_plugin, use_dcp):
            return originals["load_fsdp_model"](fsdp_plugin, accelerator, model, input_dir,
                                                model_index, adapter_only, use_dcp)
        accelerator.wait_for_everyone()
        options = fsdp_utils._prepare_sd_options(fsdp_plugin)
        state = {"model": fsdp_utils._get_model_state_dict(model, adapter_only=adapter_only,
                                                           sd_options=options)}
        dcp.load(state, storage_reader=dcpstore.get_reader(_sub(uri, FSDP_MODEL_NAME,
                                                                model_index)))
        result = fsdp_utils._set_model_state_dict(model, state["model"],
                                                  adapter_only=adapter_only, sd_options=options)
        accelerator.wait_for_everyone()
        return result

    def save_fsdp_optimizer(fsdp_plugin: Any, accelerator: Any, optimizer: Any, model: Any,
                            output_dir: str, optimizer_index: int = 0,
                            use_dcp: bool = True) -> None:
        uri = redirect.uri_for(output_dir)
        if uri is None or not _sharded_dcp(fsdp_plugin, use_dcp):
            return originals["save_fsdp_optimizer"](fsdp_plugin, accelerator, optimizer, model,
                                                    output_dir, optimizer_index, use_dcp)
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        os.makedirs(output_dir, exist_ok=True)
        options = fsdp_utils._prepare_sd_options(fsdp_plugin)
        state = get_optimizer_state_dict(model, optimizer, options=options)
        dcp.save({"optimizer": state}, storage_writer=dcpstore.get_writer(
            _sub(uri, OPTIMIZER_NAME, optimizer_index), overwrite=True))
        return None

    def load_fsdp_optimizer(fsdp_plugin: Any, accelerator: Any, optimizer: Any, model: Any,
                            input_dir: str, optimizer_index: int = 0,
                            adapter_only: bool = False, use_dcp: bool = True) -> None:
        uri = redirect.uri_for(input_dir)
        if uri is None or not _sharded_dcp(fsdp_plugin, use_dcp):
            return originals["load_fsdp_optimizer"](fsdp_plugin, accelerator, optimizer, model,
                                                    input_dir, optimizer_index, adapter_only,
                                                    use_dcp)
        from torch.distributed.checkpoint.state_dict import (
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        accelerator.wait_for_everyone()
        options = fsdp_utils._prepare_sd_options(fsdp_plugin)
        state = {"optimizer": get_optimizer_state_dict(model, optimizer, options=options)}
        dcp.load(state, storage_reader=dcpstore.get_reader(_sub(uri, OPTIMIZER_NAME,
                                                                optimizer_index)))
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)
        accelerator.wait_for_everyone()
        return None

    return {"save_fsdp_model": save_fsdp_model, "load_fsdp_model": load_fsdp_model,
            "save_fsdp_optimizer": save_fsdp_optimizer,
            "load_fsdp_optimizer": load_fsdp_optimizer}


@contextlib.contextmanager
def redirected(scratch: str, target: str, modules: Sequence[ModuleType]) -> Iterator[None]:
    """Within the block, the fsdp_utils functions named in ``modules`` send DCP parts that
    Accelerate addresses under ``scratch`` to ``target`` through dcpstore."""
    fsdp_utils = check_accelerate()
    replacements = _make_replacements(_Redirect(os.path.abspath(scratch), target), fsdp_utils)
    with _SWAP_LOCK:
        saved = [(m, n, m.__dict__[n]) for m in modules for n in _FSDP_FUNCTIONS
                 if n in m.__dict__]
        try:
            for module, name, _ in saved:
                setattr(module, name, replacements[name])
            yield
        finally:
            for module, name, original in saved:
                setattr(module, name, original)


@contextlib.contextmanager
def scratch_dir(tag: str) -> Iterator[str]:
    """A private local directory for the parts a trainer writes with file APIs."""
    path = tempfile.mkdtemp(prefix=f"dcpstore-{tag}-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def save_with_scratch(target: str, kind: str, write: Callable[[str], Any],
                      modules: Sequence[ModuleType], *, main: bool,
                      marker: dict[str, Any] | None = None, subdir: str = "") -> Any:
    """Run ``write(scratch)`` with DCP parts redirected to ``target``, store the rest, commit.

    ``scratch`` stands for ``target``; the checkpoint (where the commit marker goes) is
    ``target/subdir``.

    Collective: every rank calls it. The commit marker is removed first (an overwrite makes
    the old checkpoint at ``target`` uncommitted until the new one commits) and put last,
    by ``main``, only if every rank's part succeeded. A failed save into an empty target
    deletes what it wrote; a failed overwrite leaves an uncommitted directory.
    """
    root = dcpstore.open_backend(target)
    store = root.child(subdir) if subdir else root
    fresh = not store.list()
    _barrier()  # every rank looked before the main process changes anything
    if main:
        store.delete([COMMIT_MARKER])
    _barrier()
    error: BaseException | None = None
    result = None
    with scratch_dir(kind) as scratch:
        try:
            with redirected(scratch, target, modules):
                result = write(scratch)
            _upload_tree(scratch, root)
        except Exception as exc:  # every rank must learn of it before anyone commits
            error = exc
    try:
        _all_ok(error is None, error)
    except BaseException:
        if main and fresh:  # leave no leftovers where there was nothing before
            with contextlib.suppress(Exception):
                _delete_tree(join_uri(target, subdir) if subdir else target)
        with contextlib.suppress(Exception):  # (a broken process group fails it at once)
            _barrier()  # no rank returns before the leftovers are gone
        raise
    if main:
        _commit(store, kind, marker)
    _barrier()
    return result


# -- the Accelerator -------------------------------------------------------------------------


class DcpstoreAccelerator(Accelerator):
    """An ``accelerate.Accelerator`` whose ``save_state`` / ``load_state`` go through dcpstore.

    Use it wherever ``Accelerator`` is used; ``project_dir`` and the ``save_state`` /
    ``load_state`` directories may be dcpstore URIs (``s3://``, ``gs://``, ``msc://``) or
    local paths. FSDP2 ``SHARDED_STATE_DICT`` model and optimizer state streams through
    dcpstore's DCP writer and reader; the rest goes through the backend's ``put`` /
    ``get``; a checkpoint counts only once its commit marker is stored.

    Raises:
        UnsupportedVersionError: at construction, on an accelerate whose internals differ.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        check_accelerate()
        if kwargs.get("project_dir") is not None:
            check_uri(kwargs["project_dir"])
        super().__init__(*args, **kwargs)

    def _checkpoints_root(self) -> str:
        return join_uri(check_uri(self.project_dir), "checkpoints")

    def save_state(self, output_dir: str | os.PathLike[str] | None = None,
                   safe_serialization: bool = True, **save_model_func_kwargs: Any) -> str:
        """Save model, optimizer, schedulers, RNG states and custom objects to a URI.

        Args:
            output_dir: Checkpoint directory (URI or path). Ignored with
                ``automatic_checkpoint_naming``, which saves to
                ``<project_dir>/checkpoints/checkpoint_<iteration>``.
            safe_serialization: As in ``Accelerator.save_state``.
            **save_model_func_kwargs: As in ``Accelerator.save_state``.

        Returns:
            The checkpoint's URI.

        Raises:
            ValueError: automatic naming's next directory already holds objects.
            dcpstore.InvalidURIError: a mangled ``scheme:/`` URI.
        """
        config = self.project_configuration
        automatic = config.automatic_checkpoint_naming
        if automatic:
            target = join_uri(self._checkpoints_root(), f"checkpoint_{self.save_iteration}")
            if is_committed(target):
                raise ValueError(
                    f"Checkpoint directory {target} ({self.save_iteration}) already exists. "
                    "Set `accelerator.project_configuration.iteration` to the iteration "
                    "to continue from.")
        elif output_dir is None:
            raise ValueError("save_state needs output_dir unless ProjectConfiguration("
                             "automatic_checkpoint_naming=True) is used")
        else:
            target = check_uri(output_dir)

        stock_save = super().save_state

        def write(scratch: str) -> None:
            config.automatic_checkpoint_naming = False
            try:
                stock_save(scratch, safe_serialization, **save_model_func_kwargs)
            finally:
                config.automatic_checkpoint_naming = automatic

        logger.info("Saving current state to %s", target)
        iteration = config.iteration
        try:
            save_with_scratch(target, "accelerate", write, [accelerate.accelerator],
                              main=self.is_main_process,
                              marker={"iteration": iteration if automatic else None})
        finally:  # a rank whose own part succeeded must not move on alone
            config.iteration = iteration
        config.iteration = iteration + 1
        if automatic and config.total_limit is not None and self.is_main_process:
            rotate(self._checkpoints_root(), "checkpoint_", config.total_limit)
        self.wait_for_everyone()
        return target

    def load_state(self, input_dir: str | os.PathLike[str] | None = None,
                   load_kwargs: dict[str, Any] | None = None,
                   **load_model_func_kwargs: Any) -> None:
        """Load a committed checkpoint saved by :meth:`save_state`.

        Args:
            input_dir: Checkpoint URI or path; ``None`` with automatic naming loads the
                newest committed ``checkpoint_<n>`` and sets the project configuration's
                ``iteration`` to ``n + 1``, so the next ``save_state`` follows it.
            load_kwargs: As in ``Accelerator.load_state``.
            **load_model_func_kwargs: As in ``Accelerator.load_state``.

        Raises:
            dcpstore.IncompleteCheckpointError: the directory has no commit marker.
            dcpstore.CheckpointNotFoundError: nothing is there.
        """
        if input_dir is not None:
            source = check_uri(input_dir)
        elif self.project_configuration.automatic_checkpoint_naming:
            found = latest_checkpoint(self._checkpoints_root(), "checkpoint_")
            if found is None:
                raise CheckpointNotFoundError(
                    f"no committed checkpoint_<n> under {self._checkpoints_root()}")
            source = found
            # the next automatic save goes after it (stock Accelerate leaves this to the user)
            self.project_configuration.iteration = int(found.rsplit("_", 1)[1]) + 1
        else:
            raise ValueError("No input_dir provided and automatic checkpoint naming is "
                             "disabled.")
        from accelerate.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME

        store = require_committed(source)
        logger.info("Loading states from %s", source)
        with scratch_dir("accelerate") as scratch:
            download_extras(store, scratch, (FSDP_MODEL_NAME, OPTIMIZER_NAME))
            with redirected(scratch, source, [accelerate.accelerator]):
                super().load_state(scratch, load_kwargs, **load_model_func_kwargs)

