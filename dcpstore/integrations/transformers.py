"""HF Trainer (transformers 5.x): FSDP2 sharded checkpoints on a dcpstore URI.

The Trainer saves FSDP state with Accelerate's ``fsdp_utils`` (hard-coded
``FileSystemWriter``) and everything else with ``os.path`` / ``torch.save``, and rotates
with ``shutil.rmtree``. The user's change is one class: mix :class:`DcpstoreTrainerMixin`
into their Trainer class (or use :class:`DcpstoreTrainer`), and ``output_dir`` may be a
dcpstore URI:

>>> from dcpstore.integrations.transformers import DcpstoreTrainer
>>> args = TrainingArguments(output_dir="s3://bucket/run7", save_total_limit=3, ...)
>>> trainer = DcpstoreTrainer(model=model, args=args, train_dataset=ds)
>>> trainer.train(resume_from_checkpoint=True)     # newest committed checkpoint-<step>

A checkpoint ``<output_dir>/checkpoint-<step>`` holds the model and optimizer shards
(``pytorch_model_fsdp_0``, ``optimizer_0``: DCP, written and read by dcpstore),
``trainer_state.json``, ``scheduler.pt``, ``rng_state_<rank>.pth`` and whatever else the
Trainer writes (stored with the backend's ``put``), and a commit marker put last.
``save_total_limit`` deletes the oldest committed checkpoints through the backend, after
the new one committed; ``resume_from_checkpoint=True`` and :func:`get_last_checkpoint`
only ever name a committed checkpoint.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import dcpstore
from dcpstore.integrations.accelerate import (
    check_accelerate,
    check_uri,
    download_extras,
    is_remote,
    join_uri,
    latest_checkpoint,
    redirected,
    require_committed,
    rotate,
    save_with_scratch,
    scratch_dir,
)

try:
    import transformers
    import transformers.trainer
    from transformers import Trainer
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("dcpstore.integrations.transformers needs HF transformers: "
                      "pip install transformers accelerate") from exc

__all__ = [
    "SUPPORTED_TRANSFORMERS",
    "DcpstoreTrainer",
    "DcpstoreTrainerMixin",
    "get_last_checkpoint",
]

logger = logging.getLogger(__name__)

#: transformers releases whose Trainer internals this module was checked against.
SUPPORTED_TRANSFORMERS = ((5, 0), (5, 24))
_PREFIX = "checkpoint-"
_TRAINER_METHODS = ("_save_checkpoint", "_get_output_dir", "_load_from_checkpoint",
                    "_load_optimizer_and_scheduler", "_load_rng_state",
                    "create_accelerator_and_postprocess")


def _check_transformers() -> None:
    from dcpstore.integrations.accelerate import UnsupportedVersionError, _version_tuple

    check_accelerate()
    low, high = SUPPORTED_TRANSFORMERS
    missing = [n for n in _TRAINER_METHODS if not hasattr(Trainer, n)]
    missing += [f"transformers.trainer.{n}" for n in ("save_fsdp_model", "load_fsdp_model",
                                                       "save_fsdp_optimizer",
                                                       "load_fsdp_optimizer")
                if not hasattr(transformers.trainer, n)]
    if not low <= _version_tuple(transformers.__version__) < high or missing:
        raise UnsupportedVersionError(
            f"dcpstore's HF Trainer integration supports transformers "
            f"{low[0]}.{low[1]}-{high[0]}.{high[1] - 1}.x; found {transformers.__version__}"
            + (f" without {', '.join(missing)}" if missing else "")
            + ". Install a supported transformers (see requirements/constraints.txt).")


def get_last_checkpoint(output_dir: str | os.PathLike[str]) -> str | None:
    """The newest committed ``checkpoint-<step>`` under ``output_dir`` (URI or path), or None.

    The dcpstore counterpart of ``transformers.trainer_utils.get_last_checkpoint``: it
    lists through the store and skips directories whose save did not commit.
    """
    return latest_checkpoint(output_dir, _PREFIX)


class DcpstoreTrainerMixin:
    """Mix into a ``transformers.Trainer`` subclass to keep its checkpoints on dcpstore.

    ``class MyTrainer(DcpstoreTrainerMixin, SFTTrainer): ...`` — the mixin goes first.
    ``TrainingArguments.output_dir`` may then be a URI (``s3://``, ``gs://``, ``msc://``)
    or a local path; checkpoints go through dcpstore either way.

    Limits: FSDP2 ``SHARDED_STATE_DICT`` state streams through dcpstore's DCP writer; other
    modes (DDP, FSDP ``FULL_STATE_DICT``) work too, but their model and optimizer files
    are written to a private scratch directory first and then stored. ``push_to_hub`` and
    ``load_best_model_at_end`` are not supported with a URI ``output_dir``.

    Raises:
        dcpstore.integrations.accelerate.UnsupportedVersionError: at construction, on a
            transformers or accelerate whose internals differ.
        dcpstore.InvalidURIError: ``output_dir`` is a mangled ``scheme:/`` URI.
    """

    args: Any
    state: Any
    accelerator: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _check_transformers()
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is None or training_args.output_dir is None:
            raise ValueError("DcpstoreTrainer needs TrainingArguments(output_dir=<URI or path>)")
        root = check_uri(training_args.output_dir)
        if is_remote(root):
            for flag in ("push_to_hub", "load_best_model_at_end"):
                if getattr(training_args, flag, False):
                    raise ValueError(f"TrainingArguments.{flag} is not supported with a URI "
                                     f"output_dir ({root}) by dcpstore's Trainer integration")
            # Trainer.__init__ makes output_dir with os.makedirs: give it a scratch dir
            with scratch_dir("hf-trainer-init") as scratch:
                training_args.output_dir = scratch
                try:
                    super().__init__(*args, **kwargs)
                finally:
                    training_args.output_dir = root
        else:
            super().__init__(*args, **kwargs)

    # -- save -------------------------------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        root = check_uri(self.args.output_dir)
        run_dir = self._get_output_dir(trial=trial)  # type: ignore[attr-defined]
        step_dir = f"{_PREFIX}{self.state.global_step}"
        rel = os.path.relpath(run_dir, root) if run_dir != root else ""
        subdir = "/".join(p for p in (rel.replace(os.sep, "/"), step_dir) if p)
        stock_save = super()._save_checkpoint  # type: ignore[misc]
        best = self.state.best_model_checkpoint

        def write(scratch: str) -> None:
            self.args.output_dir = scratch
            try:
                stock_save(model, trial)
            finally:
                self.args.output_dir = root
            found = self.state.best_model_checkpoint
            if found and os.path.abspath(found).startswith(os.path.abspath(scratch)):
                # the stock code found the best step in our scratch dir: name it on the store
                self.state.best_model_checkpoint = join_uri(
                    root, os.path.relpath(found, scratch).replace(os.sep, "/"))
                if self.args.should_save:
                    self.state.save_to_json(os.path.join(scratch, subdir, "trainer_state.json"))

        try:
            save_with_scratch(root, "hf-trainer", write, [transformers.trainer],
                              main=self.args.should_save, subdir=subdir,
                              marker={"global_step": self.state.global_step})
        except BaseException:
            self.state.best_model_checkpoint = best
            raise
        limit = self.args.save_total_limit
        if limit is not None and self.args.should_save:
            protect = [self.state.best_model_checkpoint] if self.state.best_model_checkpoint else []
            if protect and limit == 1 and protect[0] != join_uri(root, subdir):
                limit = 2  # as the stock Trainer: keep the best one and the newest one
            rotate(run_dir, _PREFIX, limit, protect=protect)
        self.accelerator.wait_for_everyone()

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model``; a URI target is written to scratch, then stored."""
        target = check_uri(output_dir if output_dir is not None else self.args.output_dir)
        stock_save_model = super().save_model  # type: ignore[misc]
        if _internal_call or not is_remote(target):
            stock_save_model(target, _internal_call)
            return
        with scratch_dir("hf-save-model") as scratch:
            stock_save_model(scratch, False)
            store = dcpstore.open_backend(target)
            for dirpath, _, files in os.walk(scratch):
                for name in files:
                    path = os.path.join(dirpath, name)
                    with open(path, "rb") as f:
                        store.put(os.path.relpath(path, scratch).replace(os.sep, "/"),
                                  f.read())
        self.accelerator.wait_for_everyone()

    # -- load -------------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any,
              **kwargs: Any) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint`` may be ``True`` (the newest
        committed checkpoint under ``output_dir``) or a checkpoint URI / path.

        Raises:
            ValueError: ``True`` and no committed checkpoint exists.
            dcpstore.IncompleteCheckpointError: the named checkpoint never committed.
        """
        stock_train = super().train  # type: ignore[misc]
        if resume_from_checkpoint is False or resume_from_checkpoint is None:
            return stock_train(None, *args, **kwargs)
        if resume_from_checkpoint is True:
            found = get_last_checkpoint(self.args.output_dir)
            if found is None:
                raise ValueError("No valid checkpoint found in output directory "
                                 f"({self.args.output_dir})")
            source = found
        else:
            source = check_uri(resume_from_checkpoint)
        from accelerate.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME

        store = require_committed(source)
        logger.info("resuming from %s", source)
        with scratch_dir("hf-trainer-resume") as scratch:
            local = os.path.join(scratch, source.rstrip("/").rsplit("/", 1)[-1].split("?")[0])
            download_extras(store, local, (FSDP_MODEL_NAME, OPTIMIZER_NAME))
            with redirected(local, source, [transformers.trainer]):
                return stock_train(local, *args, **kwargs)


class DcpstoreTrainer(DcpstoreTrainerMixin, Trainer):
    """``transformers.Trainer`` with :class:`DcpstoreTrainerMixin` mixed in."""
