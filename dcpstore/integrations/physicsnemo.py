"""PhysicsNeMo: ``save_checkpoint`` / ``load_checkpoint`` / ``load_model_weights`` on
``s3://``, ``gs://``, ``msc://``, ``az://`` (any URI dcpstore serves), sharded.

The one change is an import, before PhysicsNeMo's checkpoint functions are imported:

>>> import dcpstore.integrations.physicsnemo  # noqa: F401  (routes dcpstore URIs)
>>> from physicsnemo.utils import save_checkpoint, load_checkpoint
>>> save_checkpoint("s3://bucket/run7", models=model, optimizer=opt, scheduler=sched, epoch=3)
>>> epoch = load_checkpoint("s3://bucket/run7", models=model, optimizer=opt, scheduler=sched)

Importing this module calls :func:`enable`: ``physicsnemo.utils.save_checkpoint``,
``load_checkpoint`` and ``load_model_weights`` (and the same names in
``physicsnemo.utils.checkpoint``) send every ``scheme://`` URI of a scheme dcpstore knows
to this module's functions of the same name and signature; bare local paths keep
PhysicsNeMo's own code (its ``.mdlus`` / ``.pt`` files stay readable). The functions here
can also be called directly, and then local paths go sharded too.

What is stored, for PhysicsNeMo's ``checkpoint.{mp_rank}.{epoch}`` naming: one DCP
checkpoint per (model-parallel rank, epoch), ``{path}/checkpoint.{mp_rank}.{epoch}/``,
written with dcpstore's commit protocol (never torn; an explicit ``epoch`` that exists is
replaced atomically). It holds

- ``models.{Name}.*``: each model's state dict as PhysicsNeMo names it (class name,
  FSDP2 wrapper peeled, a numeric suffix when classes repeat), sharded: FSDP2 / DTensor
  parameters stay DTensors (``get_model_state_dict`` without ``full_state_dict``), so
  every rank streams its own shards and no rank gathers the model;
- ``optimizer.*``: ``get_optimizer_state_dict`` of the optimizer, sharded the same way;
- ``training``: scheduler, scaler and static-capture state, ``epoch`` and ``metadata``,
  the dict PhysicsNeMo's ``checkpoint.{mp}.{epoch}.pt`` holds, minus the optimizer.

``load_checkpoint`` reads back at any world size and mesh (DCP reshards); ``epoch=None``
loads the highest committed epoch, found with one listing by rank 0. Only checkpoints
whose ``.metadata`` exists count (dcpstore writes it last). The sharding guard of
dcpstore's writer applies: a plain tensor that differs between ranks is refused at save,
naming its key.

Semantics kept from PhysicsNeMo 2.2: ``epoch=None`` saves at the next index (0 when
there is none); the stored ``epoch`` is only written when it is truthy, so a checkpoint
saved with ``epoch=None`` or ``0`` loads as epoch 0; a missing directory or epoch loads
nothing and returns 0 (with a warning); ``metadata_dict`` is updated in place. Models
that are neither FSDP nor DTensor-parallel are replicated state: rank 0 saves them alone
(other ranks return), and every calling rank loads them on its own, so rank-0-only calls
work as they do in PhysicsNeMo.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from dcpstore.dcp.api import get_reader, get_writer, load_with, open_backend
from dcpstore.dcp.api import load as dcp_load
from dcpstore.dcp.api import save as dcp_save
from dcpstore.dcp.dist import is_distributed, single_process_quiet, unwrap
from dcpstore.errors import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    ConfigurationError,
    InvalidURIError,
)
from dcpstore.integrations.dcp_routing import check_uri
from dcpstore.integrations.store_files import uri_text
from dcpstore.training.weights import read_metadata

__all__ = [
    "checkpoint_name",
    "committed_epochs",
    "disable",
    "enable",
    "get_checkpoint_dir",
    "is_enabled",
    "load_checkpoint",
    "load_model_weights",
    "routes",
    "save_checkpoint",
]

logger = logging.getLogger(__name__)

_ROUTED = ("save_checkpoint", "load_checkpoint", "load_model_weights")
_METADATA = ".metadata"
_MODELS = "models"
_OPTIMIZER = "optimizer"
_TRAINING = "training"
_lock = threading.Lock()
_originals: dict[tuple[Any, str], Callable[..., Any]] = {}


def _pn() -> Any:
    """``physicsnemo.utils.checkpoint`` (imported on first use)."""
    import physicsnemo.utils.checkpoint as module

    return module


def get_checkpoint_dir(base_dir: Path | str, model_name: str) -> str:
    """PhysicsNeMo's ``get_checkpoint_dir``: ``"{base_dir}/checkpoints_{model_name}"``."""
    return str(_pn().get_checkpoint_dir(base_dir, model_name))


def checkpoint_name(mp_rank: int, epoch: int) -> str:
    """The DCP checkpoint of one (model-parallel rank, epoch): PhysicsNeMo's
    ``checkpoint.{mp_rank}.{epoch}`` without its ``.pt`` extension."""
    return f"checkpoint.{mp_rank}.{epoch}"


def _join(path: str, name: str) -> str:
    return f"{path.rstrip('/')}/{name}"


def _scan(path: str, mp_rank: int) -> tuple[list[int], list[int]]:
    """(committed, all) epochs of ``checkpoint.{mp_rank}.N/`` under ``path``: one listing."""
    pattern = re.compile(rf"^checkpoint\.{mp_rank}\.(\d+)/(.*)$")
    backend = open_backend(path)
    try:
        committed: set[int] = set()
        seen: set[int] = set()
        try:
            listed = backend.list(f"checkpoint.{mp_rank}.")
        except FileNotFoundError:  # a local directory not made yet (never a bucket)
            listed = []
        for obj in listed:
            match = pattern.match(obj.key)
            if match is None:
                continue
            seen.add(int(match.group(1)))
            if match.group(2) == _METADATA:
                committed.add(int(match.group(1)))
        return sorted(committed), sorted(seen)
    finally:
        backend.close()


def committed_epochs(path: str, mp_rank: int = 0) -> list[int]:
    """The epochs under ``path`` whose checkpoint ``checkpoint.{mp_rank}.{epoch}`` is
    committed, ascending (one listing of the store)."""
    return _scan(str(path), mp_rank)[0]


def _on_rank0(fn: Callable[[], Any], collective: bool) -> Any:
    """``fn()`` on rank 0, its result (or its exception) given to every rank when
    ``collective``; otherwise ``fn()`` here."""
    if not collective:
        return fn()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = (True, fn())
        except Exception as exc:  # every rank raises it; none waits for a broadcast
            box[0] = (False, exc)
    dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if not ok:
        raise value
    return value


def _check_path(path: Path | str) -> str:
    """``path`` as a string, refused where it is a URI that lost a slash."""
    text = os.fspath(path)
    check_uri(text)
    if not text:
        raise InvalidURIError("the checkpoint path is empty")
    return text


class _Mode:
    """Who takes part: ``collective`` (every rank, sharded state) or one process."""

    def __init__(self, named: dict[str, torch.nn.Module]) -> None:
        pn = _pn()
        self.distributed = any(pn._is_distributed_model(m) for m in named.values())
        self.collective = self.distributed and is_distributed()
        self.mp_rank = 0 if self.distributed else _model_parallel_rank()


def _model_parallel_rank() -> int:
    from physicsnemo.distributed import DistributedManager

    if not DistributedManager.is_initialized():
        return 0
    manager = DistributedManager()
    if "model_parallel" in manager.group_names:
        raise ConfigurationError(
            "dcpstore's PhysicsNeMo checkpoints need the model-parallel state as FSDP2 / "
            "DTensor parameters (one sharded checkpoint for all ranks); this run has a "
            "'model_parallel' process group and plain per-rank models. Shard the models "
            "with fully_shard / DTensor, or save to a local path with PhysicsNeMo's own "
            "save_checkpoint"
        )
    return 0


def _named_models(models: Any, loading: bool) -> dict[str, torch.nn.Module]:
    if not models:
        return {}
    if not isinstance(models, list):
        models = [models]
    return dict(_pn()._unique_model_names(models, loading=loading))


def _training_state(optimizer: Any, scheduler: Any, scaler: Any, epoch: int | None,
                    metadata: dict[str, Any] | None, plain_optimizer: bool) -> dict[str, Any]:
    """What PhysicsNeMo puts in ``checkpoint.{mp}.{epoch}.pt``, less a sharded optimizer."""
    from physicsnemo.utils.capture import _StaticCapture

    state: dict[str, Any] = {}
    if optimizer and plain_optimizer:
        state["optimizer_state_dict"] = optimizer.state_dict()
    if scheduler:
        state["scheduler_state_dict"] = scheduler.state_dict()
    if scaler:
        state["scaler_state_dict"] = scaler.state_dict()
    if _StaticCapture._amp_scalers:
        state["static_capture_state_dict"] = _StaticCapture.state_dict()
    if epoch:  # PhysicsNeMo stores the epoch only when it is truthy
        state["epoch"] = epoch
    if metadata:
        state["metadata"] = metadata
    return state


def _optimizer_model(named: dict[str, torch.nn.Module],
                     optimizer_model: torch.nn.Module | None) -> torch.nn.Module | None:
    if optimizer_model is not None:
        return optimizer_model
    pn = _pn()
    return next((m for m in named.values() if pn._is_distributed_model(m)),
                next(iter(named.values()), None))


# the signatures are PhysicsNeMo's own (same names, order and defaults)
_Models = torch.nn.Module | list[torch.nn.Module] | None


def save_checkpoint(
    path: Path | str, models: _Models = None, optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None, scaler: Any = None, epoch: int | None = None,
    metadata: dict[str, Any] | None = None, optimizer_model: torch.nn.Module | None = None,
) -> None:
    """PhysicsNeMo's ``save_checkpoint``, as one sharded DCP checkpoint through dcpstore.

    Writes ``{path}/checkpoint.{mp_rank}.{epoch}/`` (see the module docstring). With
    FSDP / DTensor models every rank must call it and each streams its own shards; with
    plain models rank 0 writes alone.

    Args:
        path: A URI dcpstore serves (``s3://b/run``, ``gs://``, ``msc://``, ``az://``,
            ``file://``) or a local directory.
        models: Model(s) to save.
        optimizer: Optimizer to save (sharded like its model's parameters).
        scheduler: LR scheduler.
        scaler: AMP grad scaler.
        epoch: The checkpoint's index; ``None``: one past the highest there.
        metadata: Values kept beside the state (numbers, strings, lists, dicts,
            tensors: they load with ``weights_only`` safety).
        optimizer_model: The model whose parameters ``optimizer`` holds (default: the
            first distributed model, else the first model).

    Raises:
        dcpstore.errors.InvalidURIError: ``path`` is malformed or lost a slash.
        dcpstore.errors.BackendNotFoundError: No dcpstore backend serves the scheme.
        dcpstore.errors.ShardingError: A plain tensor differs between ranks.
    """
    path = _check_path(path)
    named = _named_models(models, loading=False)
    mode = _Mode(named)
    if not mode.collective and is_distributed() and dist.get_rank() != 0:
        return  # replicated state: rank 0 saves it
    opt_model = _optimizer_model(named, optimizer_model) if optimizer else None
    state: dict[str, Any] = {}
    if named:
        state[_MODELS] = {name: get_model_state_dict(m) for name, m in named.items()}
    if optimizer and opt_model is not None:
        state[_OPTIMIZER] = get_optimizer_state_dict(opt_model, optimizer)
    training = _training_state(optimizer, scheduler, scaler, epoch, metadata,
                               plain_optimizer=optimizer is not None and opt_model is None)
    if training:
        # a tuple is one DCP item (a dict would be flattened into keys that a load must
        # know in advance); it is torch.save-d and loads with weights_only safety
        state[_TRAINING] = (training,)
    if not state:
        return
    if epoch is None:
        seen = _on_rank0(lambda: _scan(path, mode.mp_rank)[1], mode.collective)
        index = seen[-1] + 1 if seen else 0
    else:
        index = int(epoch)
    uri = _join(path, checkpoint_name(mode.mp_rank, index))
    # an explicit epoch replaces what is there (as PhysicsNeMo does), atomically
    if mode.collective:
        dcp_save(state, uri, overwrite=True)
    else:
        _save_alone(state, uri)
    logger.info("saved PhysicsNeMo checkpoint %s", uri)


def _save_alone(state: dict[str, Any], uri: str) -> None:
    """``dcp.save`` by this process alone, even where a process group exists."""
    writer = get_writer(uri, overwrite=True)
    try:
        with single_process_quiet():
            dcp.save(state, storage_writer=writer, no_dist=True)
    except CheckpointException as exc:
        writer.discard()
        raise unwrap(exc) from exc
    finally:
        writer.backend.close()


def _load_alone(state: dict[str, Any], uri: str, planner: Any = None) -> None:
    load_with(get_reader(uri), state, planner=planner, no_dist=True)


def _saved_keys(uri: str) -> list[str]:
    return list(read_metadata(uri).state_dict_metadata)


def load_checkpoint(
    path: Path | str, models: _Models = None, optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None, scaler: Any = None, epoch: int | None = None,
    metadata_dict: dict[str, Any] | None = None, device: str | torch.device = "cpu",
    optimizer_model: torch.nn.Module | None = None,
) -> int:
    """PhysicsNeMo's ``load_checkpoint`` from a checkpoint :func:`save_checkpoint` wrote,
    at any world size (each rank reads only the bytes of its own shards).

    Args:
        path: The directory (URI) given to :func:`save_checkpoint`.
        models: Model(s) to restore (matched by PhysicsNeMo's names).
        optimizer: Optimizer to restore.
        scheduler: LR scheduler to restore.
        scaler: AMP grad scaler to restore.
        epoch: The index to load; ``None``: the highest committed one.
        metadata_dict: Updated in place with the saved ``metadata``.
        device: ``map_location`` of the small training state.
        optimizer_model: The model whose parameters ``optimizer`` holds.

    Returns:
        The stored epoch; 0 where nothing was loaded or none was stored.

    Raises:
        dcpstore.errors.BackendNotFoundError, dcpstore.errors.BucketNotFoundError:
            The store cannot be reached as named (never read as "no checkpoint").
        dcpstore.errors.CheckpointMismatchError: The models do not match the checkpoint.
    """
    path = _check_path(path)
    named = _named_models(models, loading=True)
    mode = _Mode(named)
    if epoch is None:
        committed = _on_rank0(lambda: _scan(path, mode.mp_rank)[0], mode.collective)
        if not committed:
            logger.warning("no committed PhysicsNeMo checkpoint under %s: skipping load", path)
            return 0
        index = committed[-1]
    else:
        index = int(epoch)
    uri = _join(path, checkpoint_name(mode.mp_rank, index))

    def keys() -> list[str] | None:
        try:
            return _saved_keys(uri)
        except CheckpointNotFoundError:
            return None

    saved = _on_rank0(keys, mode.collective)
    if saved is None:
        logger.warning("no checkpoint %s: skipping load", uri)
        return 0
    prefixes = {k.split(".", 2)[1] for k in saved if k.startswith(_MODELS + ".")}
    state: dict[str, Any] = {}
    present: dict[str, torch.nn.Module] = {}
    for name, model in named.items():
        if name in prefixes:
            present[name] = model
        else:
            logger.error("%s holds no model %s (it has %s): skipping it", uri, name,
                         ", ".join(sorted(prefixes)) or "none")
    if present:
        state[_MODELS] = {name: get_model_state_dict(m) for name, m in present.items()}
    opt_model = _optimizer_model(named, optimizer_model) if optimizer else None
    if optimizer and opt_model is not None and any(k.startswith(_OPTIMIZER + ".")
                                                   for k in saved):
        state[_OPTIMIZER] = get_optimizer_state_dict(opt_model, optimizer)
    if _TRAINING in saved:
        state[_TRAINING] = ()  # replaced by the saved (training,)
    if mode.collective:
        dcp_load(state, uri)
    else:
        _load_alone(state, uri)
    for name, model in present.items():
        set_model_state_dict(model, state[_MODELS][name])
    if _OPTIMIZER in state:
        assert opt_model is not None and optimizer is not None
        set_optimizer_state_dict(opt_model, optimizer, state[_OPTIMIZER])
    loaded: tuple[Any, ...] = state.get(_TRAINING) or ({},)
    training = loaded[0] if isinstance(loaded[0], dict) else {}
    training = {k: _to_device(v, device) for k, v in training.items()}
    if optimizer and "optimizer_state_dict" in training:
        optimizer.load_state_dict(training["optimizer_state_dict"])
    if scheduler and "scheduler_state_dict" in training:
        scheduler.load_state_dict(training["scheduler_state_dict"])
    if scaler and "scaler_state_dict" in training:
        scaler.load_state_dict(training["scaler_state_dict"])
    if "static_capture_state_dict" in training:
        from physicsnemo.utils.capture import _StaticCapture

        _StaticCapture.load_state_dict(training["static_capture_state_dict"])
    if metadata_dict is not None:
        metadata_dict.update(training.get("metadata", {}))
    logger.info("loaded PhysicsNeMo checkpoint %s", uri)
    return int(training.get("epoch", 0))


def _to_device(value: Any, device: str | torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


_FILE = re.compile(r"^(?P<name>.+)\.(?P<mp>\d+)\.(?P<epoch>\d+)\.(?:mdlus|pt)$")


def _weights_location(weights_path: str, named: str) -> tuple[str, str | None]:
    """(checkpoint URI, model name in it) for ``weights_path``: a checkpoint
    (``.../checkpoint.0.3``), a directory of them (the highest committed epoch), or the
    name PhysicsNeMo gives a model file (``.../FullyConnected.0.3.mdlus``)."""
    parent, _, leaf = weights_path.rstrip("/").rpartition("/")
    match = _FILE.match(leaf)
    if match is not None:
        return _join(parent, checkpoint_name(int(match["mp"]), int(match["epoch"]))), \
            match["name"]
    backend = open_backend(weights_path)
    try:
        if backend.exists(_METADATA):
            return weights_path, None
    finally:
        backend.close()
    committed = committed_epochs(weights_path)
    if not committed:
        raise CheckpointNotFoundError(
            f"no PhysicsNeMo checkpoint at {weights_path}: give a checkpoint "
            "(…/checkpoint.0.N), the directory save_checkpoint wrote, or a model file name "
            f"(…/{named}.0.N.mdlus)")
    return _join(weights_path, checkpoint_name(0, committed[-1])), None


def load_model_weights(
    model: torch.nn.Module,
    weights_path: str,
    device: str | torch.device = "cpu",
) -> None:
    """PhysicsNeMo's ``load_model_weights``: one model's weights alone, at any world size.

    Args:
        model: Plain, FSDP2 or DTensor-parallel (collective when distributed).
        weights_path: A checkpoint ``{path}/checkpoint.{mp}.{epoch}``, the directory
            ``path`` (its highest committed epoch), or PhysicsNeMo's model file name
            ``{path}/{Name}.{mp}.{epoch}.mdlus`` (read from that epoch's checkpoint).
        device: Unused (tensors load into the model's own); kept for the signature.

    Raises:
        dcpstore.errors.CheckpointNotFoundError: Nothing to load there.
        dcpstore.errors.CheckpointMismatchError: The checkpoint holds no such model.
    """
    del device
    weights_path = _check_path(weights_path)
    pn = _pn()
    model = pn._unwrap_ddp_compile(model, loading=True)
    name = pn._unwrapped_class_name(model)
    collective = pn._is_distributed_model(model) and is_distributed()

    def locate() -> tuple[str, str, list[str]]:
        uri, wanted = _weights_location(weights_path, name)
        saved = _saved_keys(uri)
        held = sorted({k.split(".", 2)[1] for k in saved if k.startswith(_MODELS + ".")})
        pick = wanted or (name if name in held else held[0] if len(held) == 1 else None)
        if pick is None or pick not in held:
            raise CheckpointMismatchError(
                f"{uri} holds the models {', '.join(held) or 'none'}, not {wanted or name}: "
                "name the model file ({path}/{Name}.{mp}.{epoch}.mdlus) to pick one")
        return uri, pick, saved

    uri, pick, saved = _on_rank0(locate, collective)
    target = get_model_state_dict(model)
    prefix = f"{_MODELS}.{pick}."
    missing = [k for k in target if prefix + k not in saved]
    if missing:
        raise CheckpointMismatchError(
            f"{uri}: model {pick} lacks {len(missing)} key(s) of this model, e.g. "
            f"{', '.join(missing[:5])}")
    flat = {prefix + k: v for k, v in target.items()}
    planner = DefaultLoadPlanner(allow_partial_load=True)
    if collective:
        dcp_load(flat, uri, planner=planner)
    else:
        _load_alone(flat, uri, planner)
    set_model_state_dict(model, {k: flat[prefix + k] for k in target},
                         options=StateDictOptions(strict=True))
    logger.info("loaded %s weights from %s", pick, uri)


# -- routing PhysicsNeMo's own functions ------------------------------------------------


def _known_schemes() -> set[str]:
    from dcpstore.storage.registry import KNOWN_SCHEMES, available_backends

    return {s.lower() for s in (*KNOWN_SCHEMES, *available_backends())}


def routes(path: Any) -> bool:
    """Whether PhysicsNeMo's functions, once enabled, send ``path`` to dcpstore: a
    ``scheme://`` URI of a scheme dcpstore knows (its backend may still be missing: then
    the call raises the backend's "pip install ..." error, it never falls back).

    Raises:
        dcpstore.integrations.dcp_routing.MangledURIError: ``path`` lost a slash
            (``Path("s3://b/x")`` is ``s3:/b/x``) and would become a local directory.
    """
    text = uri_text(path)
    return text is not None and text.partition("://")[0].lower() in _known_schemes()


def _routed(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    ours = globals()[name]

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        target = kwargs.get("weights_path" if name == "load_model_weights" else "path")
        if target is None:
            target = args[1] if name == "load_model_weights" and len(args) > 1 else \
                args[0] if args and name != "load_model_weights" else None
        if routes(target):
            return ours(*args, **kwargs)
        return original(*args, **kwargs)

    call.__dcpstore_original__ = original  # type: ignore[attr-defined]
    return call


def enable() -> None:
    """Route ``physicsnemo.utils`` (and ``physicsnemo.utils.checkpoint``)
    ``save_checkpoint`` / ``load_checkpoint`` / ``load_model_weights`` for dcpstore URIs
    (see :func:`routes`). Idempotent; importing this module calls it. Modules that
    imported those functions by name earlier get the routed ones as well; a function's
    local name bound before this call keeps PhysicsNeMo's original."""
    import physicsnemo.utils as utils

    checkpoint = _pn()
    with _lock:
        for name in _ROUTED:
            made: dict[int, Callable[..., Any]] = {}  # one wrapper per original function
            for module in (checkpoint, utils):
                current = getattr(module, name)
                if hasattr(current, "__dcpstore_original__"):
                    continue
                _originals[(module, name)] = current
                if id(current) not in made:
                    made[id(current)] = _routed(name, current)
                setattr(module, name, made[id(current)])
            # modules that ran `from physicsnemo.utils import save_checkpoint` before this
            # import hold PhysicsNeMo's function itself: give them the routed one too
            for module in list(sys.modules.values()):
                names = getattr(module, "__dict__", None)
                if not isinstance(names, dict):
                    continue
                current = names.get(name)
                if current is not None and id(current) in made:
                    _originals[(module, name)] = current
                    setattr(module, name, made[id(current)])


def disable() -> None:
    """Give PhysicsNeMo its own functions back."""
    with _lock:
        for (module, name), original in _originals.items():
            setattr(module, name, original)
        _originals.clear()


def is_enabled() -> bool:
    """Whether PhysicsNeMo's functions route dcpstore URIs now."""
    return bool(_originals)


enable()
