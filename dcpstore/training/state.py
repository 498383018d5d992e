"""Training state that saves and loads symmetrically on every rank.

``AppState`` wraps a model and its optimizer (and optionally an LR scheduler and extra
values) as a DCP ``Stateful`` using ``torch.distributed.checkpoint.state_dict``, so plain
modules, DDP, FSDP2 (``fully_shard``) and DTensor-parallel models keep their optimizer
state as DTensors: no gather on save, no scatter on load, reshardable at any world size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from dcpstore.torch_internals import local_tensor

__all__ = ["AppState", "frozen_keys"]


class AppState(Stateful):
    """Model + optimizer (+ scheduler, + extra) as one DCP ``Stateful``.

    Args:
        model: The model (plain, DDP, FSDP2 or DTensor-parallel).
        optimizer: Its optimizer, or ``None`` to save the model alone.
        lr_scheduler: An LR scheduler with ``state_dict``/``load_state_dict``.
        extra: More state: ``Stateful`` objects or plain values (numbers, strings,
            tensors); plain values are updated in place on load.
        options: ``StateDictOptions`` for ``get_state_dict``/``set_state_dict``.
        frozen_hint: Parameters with ``requires_grad=False`` do not change between
            saves: an incremental :class:`~dcpstore.Checkpointer` references them from
            the previous step without hashing them (size, dtype and shape are still
            compared). Leave it off if frozen parameters are modified in place.

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
        frozen_hint: bool = False,
    ) -> None:
        self.model = model
        self.frozen_hint = frozen_hint
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

    def frozen_model_keys(self) -> list[str]:
        """Keys (in ``state_dict()["model"]``) of the parameters with
        ``requires_grad=False``; empty unless ``frozen_hint``."""
        if not self.frozen_hint:
            return []
        frozen = {_storage_of(p) for p in self.model.parameters() if not p.requires_grad}
        frozen.discard(None)
        if not frozen:
            return []
        model_sd = get_model_state_dict(self.model, options=self.options)
        return sorted(k for k, v in model_sd.items()
                      if isinstance(v, torch.Tensor) and _storage_of(v) in frozen)

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


def _storage_of(tensor: torch.Tensor) -> tuple[int, int, tuple[int, ...]] | None:
    """Where a (local shard of a) tensor lies: same place, same tensor."""
    local = local_tensor(tensor)
    if local.numel() == 0:
        return None
    return local.data_ptr(), local.numel(), tuple(local.shape)


def frozen_keys(state: Mapping[str, Any]) -> tuple[str, ...]:
    """Flattened keys (as DCP names them: ``app.model.base.weight``) of the frozen
    parameters of every ``AppState(frozen_hint=True)`` at the top level of ``state``."""
    keys: list[str] = []
    for name, value in state.items():
        if isinstance(value, AppState):
            keys += [f"{name}.model.{k}" for k in value.frozen_model_keys()]
    return tuple(keys)
