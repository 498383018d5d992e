"""The strategy: :class:`DcpstoreModelParallelStrategy`, Lightning's
``ModelParallelStrategy`` whose sharded checkpoints are saved (in place or in the
background), loaded and removed through dcpstore."""

from __future__ import annotations

import functools
import hashlib
import inspect
import io
import logging
import os
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.launchers.launcher import _Launcher

import dcpstore
from dcpstore.errors import ConfigurationError
from dcpstore.integrations.lightning.filesystem import _find_last
from dcpstore.integrations.lightning.retention import LAST_COPY_PREFIX, _CheckpointStore
from dcpstore.integrations.lightning.uris import _is_remote, _join, _split, checked_uri
from dcpstore.torch_internals import group_timeout

__all__ = ["META_KEY", "DcpstoreModelParallelStrategy"]

logger = logging.getLogger(__name__)

#: Key of Lightning's non-tensor state (``meta.pt`` in stock Lightning) inside the checkpoint.
META_KEY = "lightning_meta"


@dataclass
class _Pending:
    """An async save in flight and what waits for its commit."""

    uri: str
    future: Future[Any]
    writer: Any = None
    after_commit: list[Callable[[], None]] = field(default_factory=list)


class _DirectLauncher(_Launcher):
    """Runs the trainer function in this process (ranks made by torchrun or the like),
    after the strategy has looked at the trainer."""

    def __init__(self, strategy: DcpstoreModelParallelStrategy) -> None:
        self._strategy = strategy

    @property
    def is_interactive_compatible(self) -> bool:
        return True

    def launch(self, function: Callable[..., Any], *args: Any, trainer: Any = None,
               **kwargs: Any) -> Any:
        if trainer is not None:
            self._strategy._attach(trainer)
        return function(*args, **kwargs)

    def kill(self, signum: Any) -> None:
        return None


class DcpstoreModelParallelStrategy(_CheckpointStore, ModelParallelStrategy):
    """``ModelParallelStrategy`` (FSDP2 / tensor parallel) whose checkpoints go through dcpstore.

    Takes every argument of :class:`lightning.pytorch.strategies.ModelParallelStrategy`, plus:

    Args:
        *args: Passed to ``ModelParallelStrategy``.
        async_save: Save in the background (``dcp.async_save`` on a dedicated gloo group)
            from a snapshot of the state; retention and "last" advance only after commit.
        dcpstore_options: Backend, writer and reader options for every URI (see
            :func:`dcpstore.get_writer`), e.g. ``{"max_concurrency": 16}``.
        **kwargs: Passed to ``ModelParallelStrategy``.

    Raises:
        ValueError: ``save_distributed_checkpoint=False`` (full single-file checkpoints are
            not what this strategy is for).
    """

    def __init__(self, *args: Any, async_save: bool = False,
                 dcpstore_options: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self._save_distributed_checkpoint:
            raise ValueError(
                "DcpstoreModelParallelStrategy saves sharded (distributed) checkpoints only; "
                "drop save_distributed_checkpoint=False"
            )
        self.async_save = async_save
        self._options = dict(dcpstore_options or {})
        self._ckpt_group: Any = None
        self._pending: _Pending | None = None
        self._failed: BaseException | None = None
        self._trainer: Any = None
        # rank 0's bookkeeping: what was committed last, what "last" names, what not to delete
        self._last_save: tuple[str, Any] | None = None
        self._pointers: dict[str, str] = {}
        self._looked_up: set[str] = set()
        self._resumed: set[str] = set()
        self._deferred: list[str] = []

    # -- wiring ----------------------------------------------------------------------------

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        inner = self._launcher
        if inner is None:
            self._launcher = _DirectLauncher(self)
            return
        launch = inner.launch

        def launch_attached(function: Callable[..., Any], *args: Any, trainer: Any = None,
                            **kwargs: Any) -> Any:
            if trainer is not None:
                self._attach(trainer)
            return launch(function, *args, trainer=trainer, **kwargs)

        setattr(inner, "launch", launch_attached)  # noqa: B010 - an instance override

    def _attach(self, trainer: Any) -> None:
        """Refuse mangled checkpoint directories before training, and let
        ``ckpt_path="last"`` find pointers on dcpstore URIs (Lightning's own search
        normalizes ``s3://`` to ``s3:/``)."""
        self._trainer = trainer
        checked_uri(trainer.default_root_dir)
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
                checked_uri(callback.dirpath)  # refuse a mangled dirpath before training
            if isinstance(callback, ModelCheckpoint) and not getattr(callback, "_dcpstore", False):
                original = callback._find_last_checkpoints
                setattr(callback, "_find_last_checkpoints", _find_last(callback, original))  # noqa: B010
                setattr(callback, "_dcpstore", True)  # noqa: B010

    def setup_environment(self) -> None:
        super().setup_environment()
        if self.async_save and dist.is_initialized() and self._ckpt_group is None:
            # background saves must not share the training collectives' group; theirs
            # fails as soon as the training group would (new_group's default: 30 min)
            self._ckpt_group = dist.new_group(backend="gloo", timeout=group_timeout())

    def teardown(self) -> None:
        try:
            self.wait()
        finally:
            try:
                if self.global_rank == 0:
                    # deletions still deferred: this process's bookkeeping ends here
                    self._flush_deferred()
            finally:
                super().teardown()

    # -- the store (the rest is _CheckpointStore's) ----------------------------------------

    def _resolve(self, uri: str) -> str:
        """Follow a "last" pointer (on rank 0, broadcast)."""
        target = self._known_target(uri) if self.global_rank == 0 else None
        target = self.broadcast(target)
        return target or uri

    def _pointer_uris(self) -> list[str]:
        trainer = self._trainer
        if trainer is None:
            return []
        return [os.fspath(cb.last_model_path) for cb in trainer.checkpoint_callbacks
                if isinstance(cb, ModelCheckpoint) and cb.last_model_path]

    # -- async bookkeeping -----------------------------------------------------------------

    def _after_commit(self, action: Callable[[], None]) -> None:
        """Run ``action`` on rank 0 once the save in flight committed (now if none is)."""
        if self.global_rank != 0:
            return
        if self._pending is not None:
            self._pending.after_commit.append(action)
        else:
            action()

    def _settle(self, block: bool) -> None:
        pending = self._pending
        if pending is None or (not block and not pending.future.done()):
            return
        self._pending = None
        try:
            pending.future.result()
        except BaseException as exc:
            _close_writer(pending.writer)
            logger.error("async checkpoint save to %s failed: %s", pending.uri, exc)
            self._failed = exc
            if self.global_rank == 0:
                self._discard(pending.uri)
            return
        _close_writer(pending.writer)
        logger.info("committed checkpoint %s", pending.uri)
        for action in pending.after_commit:
            action()

    def wait(self) -> None:
        """Wait for the async save in flight; raise if a background save failed.

        Raises:
            RuntimeError: A background save failed (its files were removed; the previous
                checkpoint and "last" are unchanged).
        """
        self._settle(block=True)
        self._raise_failed()

    def _raise_failed(self) -> None:
        failed, self._failed = self._failed, None
        if failed is not None:
            raise RuntimeError(
                f"an async checkpoint save failed: {failed}. Nothing of it was committed; the "
                "previous checkpoint and 'last' are unchanged"
            ) from failed

    # -- save / load / remove --------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any | None = None) -> None:
        """Save a sharded checkpoint to ``filepath`` (any dcpstore URI or local path)."""
        if storage_options is not None:
            raise TypeError(
                f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not "
                "supported; give dcpstore options as DcpstoreModelParallelStrategy("
                "dcpstore_options=...)"
            )
        uri = checked_uri(self.broadcast(filepath))
        fingerprint = _fingerprint(checkpoint)
        step = checkpoint.get("global_step")
        if self._is_last(uri):
            if self._last_save is not None and self._last_save[1] == fingerprint:
                # the save in flight (if any) is that checkpoint: the pointer waits for it
                target = self._last_save[0]
                self._after_commit(lambda: self._write_pointer(uri, target, step))
                return
            parent, _ = _split(uri)
            tag = self.broadcast(uuid.uuid4().hex[:8])
            target = _join(parent, f"{LAST_COPY_PREFIX}{step}-{tag}")
            self.wait()
            self._save(checkpoint, target, fingerprint)
            self._after_commit(lambda: self._write_pointer(uri, target, step))
            return
        self.wait()  # one save in flight at a time
        self._save(checkpoint, uri, fingerprint)

    def _is_last(self, uri: str) -> bool:
        trainer = self._trainer or (self.lightning_module.trainer
                                    if self.lightning_module is not None else None)
        if trainer is None:
            return False
        return any(isinstance(cb, ModelCheckpoint) and cb.last_model_path
                   and os.fspath(cb.last_model_path) == uri
                   for cb in trainer.checkpoint_callbacks)

    def _save(self, checkpoint: dict[str, Any], uri: str, fingerprint: Any) -> None:
        state: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s
                      for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        meta = None
        if self.global_rank == 0:
            buffer = io.BytesIO()
            torch.save(checkpoint, buffer)
            meta = buffer.getvalue()
        meta = self.broadcast(meta)
        assert meta is not None
        state[META_KEY] = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
        options = {"overwrite": True, **self._writer_options()}
        if not self.async_save:
            dcpstore.save(state, uri, **options)
            logger.info("committed checkpoint %s", uri)
            self._last_save = (uri, fingerprint)
            return
        # dcp.async_save stages (copies) the state into CPU memory before it returns, so
        # training may change the parameters while the upload runs
        writer = dcpstore.get_writer(uri, **options)
        future = dcp.async_save(state, storage_writer=writer, process_group=self._ckpt_group)
        assert isinstance(future, Future), "dcp.async_save returned no Future"
        self._pending = _Pending(uri, future, writer)
        self._last_save = (uri, fingerprint)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        """Load model and optimizer shards in place (any world size) and return the rest."""
        uri = self._resolve(checked_uri(self.broadcast(checkpoint_path)))
        # not deleted while it is read; once loaded, retention may let it go like any other
        self._resumed.add(uri)
        try:
            return self._load(uri, weights_only)
        finally:
            self._resumed.discard(uri)

    def _load(self, uri: str, weights_only: bool | None) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        module = self.model
        assert module is not None and self.lightning_module is not None
        strict = self.lightning_module.strict_loading
        reader = dcpstore.get_reader(uri, **self._reader_options())
        try:
            size = reader.read_metadata().state_dict_metadata[META_KEY].size  # type: ignore[union-attr]
        except KeyError:
            raise ValueError(
                f"{uri} is a DCP checkpoint without Lightning's state ({META_KEY!r}); it was not "
                "written by DcpstoreModelParallelStrategy. Load weights alone with "
                "dcpstore.load_model_weights"
            ) from None
        finally:
            reader.backend.close()
        optimizers = {f"optimizer_{i}": opt for i, opt in enumerate(self.optimizers)}
        state: dict[str, Any] = {
            "state_dict": get_model_state_dict(module),
            **{k: get_optimizer_state_dict(module, opt) for k, opt in optimizers.items()},
            META_KEY: torch.empty(tuple(size), dtype=torch.uint8),
        }
        if not strict:
            # keys the model lacks are not loaded; keys the checkpoint lacks are kept
            saved = dcpstore.get_reader(uri, **self._reader_options())
            try:
                have = set(saved.read_metadata().state_dict_metadata)
            finally:
                saved.backend.close()
            state["state_dict"] = {k: v for k, v in state["state_dict"].items()
                                   if f"state_dict.{k}" in have}
        dcpstore.load(state, uri, **self._reader_options())
        set_model_state_dict(module, state["state_dict"],
                             options=StateDictOptions(strict=strict))
        for key, opt in optimizers.items():
            set_optimizer_state_dict(module, opt, optim_state_dict=state[key])
        meta = torch.load(io.BytesIO(state[META_KEY].numpy().tobytes()), weights_only=weights_only)
        logger.info("restored model, optimizer and trainer state from %s", uri)
        return dict(meta)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Delete a checkpoint through dcpstore (rank 0), after the save in flight committed."""
        if self.global_rank != 0:
            return
        uri = checked_uri(filepath)
        self._settle(block=False)
        self._after_commit(lambda: self._delete(uri))


def _close_writer(writer: Any) -> None:
    """Release the connections and threads of a writer made for one async save."""
    backend = getattr(writer, "backend", None)
    if backend is not None:
        backend.close()


def _fingerprint(checkpoint: Mapping[str, Any]) -> tuple[Any, ...]:
    """Identifies the training state a save captured (step, epoch and loop progress)."""
    buffer = io.BytesIO()
    torch.save(checkpoint.get("loops"), buffer)
    return (checkpoint.get("global_step"), checkpoint.get("epoch"),
            hashlib.sha256(buffer.getvalue()).hexdigest())


# -- other strategies --------------------------------------------------------------------


def _refuse_other_strategy(trainer: Any, paths: list[tuple[str, Any]]) -> None:
    """Refuse a dcpstore URI (or a mangled one) among ``paths`` when the trainer's strategy
    is not :class:`DcpstoreModelParallelStrategy`.

    Raises:
        dcpstore.errors.ConfigurationError: A dcpstore URI for a strategy that does not
            save through dcpstore.
        dcpstore.InvalidURIError: A URI that ``pathlib`` / ``normpath`` mangled.
    """
    strategy = trainer.strategy
    if isinstance(strategy, DcpstoreModelParallelStrategy):
        return  # its own checks run when it attaches to the trainer
    for what, path in paths:
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            continue
        uri = checked_uri(path)
        if _is_remote(uri):
            scheme = uri.split("://", 1)[0]
            raise ConfigurationError(
                f"{type(strategy).__name__} does not save checkpoints through dcpstore, and "
                f"this Trainer was given the dcpstore URI {uri!r} as {what}. Lightning's own "
                "checkpoint code does not serve it (FSDPStrategy and ModelParallelStrategy "
                f"write the shards into a local directory named '{scheme}:', and "
                "ckpt_path='last' finds nothing on the store, so training silently starts "
                "over). Use dcpstore.integrations.lightning.DcpstoreModelParallelStrategy "
                "(FSDP2 / tensor parallel, e.g. DcpstoreModelParallelStrategy("
                "data_parallel_size=N, tensor_parallel_size=1) in place of FSDPStrategy), or "
                "give this Trainer local paths"
            )


def _trainer_paths(trainer: Any, ckpt_path: Any) -> list[tuple[str, Any]]:
    """Where a run's checkpoints go and come from: ``default_root_dir``, each
    ``ModelCheckpoint`` directory (the first logger's ``save_dir`` where it has none) and
    ``ckpt_path``."""
    paths: list[tuple[str, Any]] = [("default_root_dir", trainer.default_root_dir)]
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint):
            continue
        if callback.dirpath is not None:
            paths.append(("ModelCheckpoint(dirpath=...)", callback.dirpath))
        elif trainer.loggers:
            paths.append(("the logger's save_dir (where ModelCheckpoint saves)",
                          trainer.loggers[0].save_dir))
    paths.append(("ckpt_path", ckpt_path))
    return paths


def _guarded(method: Callable[..., Any], path_argument: str, whole_run: bool
             ) -> Callable[..., Any]:
    signature = inspect.signature(method)

    @functools.wraps(method)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            path = signature.bind(self, *args, **kwargs).arguments.get(path_argument)
        except TypeError:  # Lightning says what is wrong with the call
            return method(self, *args, **kwargs)
        paths = _trainer_paths(self, path) if whole_run else [(path_argument, path)]
        _refuse_other_strategy(self, paths)
        return method(self, *args, **kwargs)

    setattr(guarded, "_dcpstore_guard", True)  # noqa: B010
    return guarded


def _guard_trainer() -> list[str]:
    """Make ``Trainer.fit`` / ``validate`` / ``test`` / ``predict`` / ``save_checkpoint``
    refuse a dcpstore URI unless the strategy is :class:`DcpstoreModelParallelStrategy`.

    Called when this module is imported. Lightning's other strategies (``FSDPStrategy``,
    ``DDPStrategy``, a single device, stock ``ModelParallelStrategy``, ...) pass checkpoint
    paths through ``pathlib``: an ``s3://`` checkpoint would land in a local directory named
    ``s3:``, and ``ckpt_path="last"`` would silently start from scratch. They are refused
    when the run starts, before anything is written, with
    :class:`~dcpstore.errors.ConfigurationError`.

    Returns:
        The ``Trainer`` methods guarded by this call (none when they already were).
    """
    from lightning.pytorch import Trainer

    guarded = []
    for name, argument, whole_run in (("fit", "ckpt_path", True),
                                      ("validate", "ckpt_path", True),
                                      ("test", "ckpt_path", True),
                                      ("predict", "ckpt_path", True),
                                      ("save_checkpoint", "filepath", False)):
        method = getattr(Trainer, name)
        if not getattr(method, "_dcpstore_guard", False):
            setattr(Trainer, name, _guarded(method, argument, whole_run))
            guarded.append(name)
    return guarded


_guard_trainer()
