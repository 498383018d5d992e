"""Training state that saves and loads symmetrically on every rank.

``AppState`` wraps a model and its optimizer (and optionally an LR scheduler and extra
values) as a DCP ``Stateful`` using ``torch.distributed.checkpoint.state_dict``, so plain
modules, DDP, FSDP2 (``fully_shard``) and DTensor-parallel models keep their optimizer
state as DTensors: no gather on save, no scatter on load, reshardable at any world size.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

__all__ = ["AppState"]


class AppState(Stateful):
    """Model + optimizer (+ scheduler, + extra) as one DCP ``Stateful``.

    Args:
        model: The model (plain, DDP, FSDP2 or DTensor-parallel).
        optimizer: Its optimizer, or ``None`` to save the model alone.
        lr_scheduler: An LR scheduler with ``state_dict``/``load_state_dict``.
        extra: More state: ``Stateful`` objects or plain values (numbers, strings,
            tensors); plain values are updated in place on load.
        options: ``StateDictOptions`` for ``get_state_dict``/``set_state_dict``.

    Example:
        >>> dcpstore.save({"app": AppState(model, optim)}, uri)
        >>> dcpstore.load({"app": AppState(model, optim)}, uri)  # any world size
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        extra: dict[str, Any] | None = None,
        options: StateDictOptions | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.extra = extra if extra is not None else {}
        self.options = options

    def _optimizers(self) -> tuple[Any, ...]:
        if self.optimizer is None:
            return ()
        if isinstance(self.optimizer, (list, tuple)):
            return tuple(self.optimizer)
        return (self.optimizer,)

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self._optimizers(), options=self.options)
        out: dict[str, Any] = {"model": model_sd}
        if self.optimizer is not None:
            out["optim"] = optim_sd
        if self.lr_scheduler is not None:
            out["lr_scheduler"] = self.lr_scheduler.state_dict()
        if self.extra:
            out["extra"] = {
                k: v.state_dict() if isinstance(v, Stateful) else v for k, v in self.extra.items()
            }
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self._optimizers(),
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict.get("optim", {}),
            options=self.options,
        )
        if self.lr_scheduler is not None and "lr_scheduler" in state_dict:
            self.lr_scheduler.load_state_dict(state_dict["lr_scheduler"])
        for key, value in state_dict.get("extra", {}).items():
            current = self.extra.get(key)
            if isinstance(current, Stateful):
                current.load_state_dict(value)
            else:
                self.extra[key] = value
