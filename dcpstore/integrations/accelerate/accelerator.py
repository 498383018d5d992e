"""The Accelerator: :class:`DcpstoreAccelerator`, whose ``save_state`` / ``load_state``
go through dcpstore."""

from __future__ import annotations

import logging
import os
from typing import Any

try:
    import accelerate.accelerator
    from accelerate import Accelerator
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("dcpstore.integrations.accelerate needs HF Accelerate: "
                      "pip install accelerate") from exc

from dcpstore.errors import CheckpointNotFoundError
from dcpstore.integrations.accelerate import scratch as scratch_space
from dcpstore.integrations.accelerate import store as commits
from dcpstore.integrations.accelerate.fsdp import redirected
from dcpstore.integrations.accelerate.uris import check_uri, join_uri
from dcpstore.integrations.accelerate.versions import check_accelerate

__all__ = ["DcpstoreAccelerator"]

logger = logging.getLogger(__name__)


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
            if commits.is_committed(target):
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
            scratch_space.save_with_scratch(target, "accelerate", write, [accelerate.accelerator],
                              main=self.is_main_process,
                              marker={"iteration": iteration if automatic else None})
        finally:  # a rank whose own part succeeded must not move on alone
            config.iteration = iteration
        config.iteration = iteration + 1
        if automatic and config.total_limit is not None and self.is_main_process:
            commits.rotate(self._checkpoints_root(), "checkpoint_", config.total_limit)
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
            found = commits.latest_checkpoint(self._checkpoints_root(), "checkpoint_")
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

        store = commits.require_committed(source)
        logger.info("Loading states from %s", source)
        with scratch_space.scratch_dir("accelerate") as scratch:
            scratch_space.download_extras(store, scratch, (FSDP_MODEL_NAME, OPTIMIZER_NAME))
            with redirected(scratch, source, [accelerate.accelerator]):
                super().load_state(scratch, load_kwargs, **load_model_func_kwargs)
