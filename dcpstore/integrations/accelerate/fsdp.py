"""Accelerate's ``fsdp_utils`` save/load functions, redirected: within
:func:`redirected`, DCP parts addressed to a local scratch directory stream to the
checkpoint URI through dcpstore."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch.distributed.checkpoint as dcp

import dcpstore
from dcpstore.integrations.accelerate.uris import join_uri
from dcpstore.integrations.accelerate.versions import (
    _FSDP_FUNCTIONS,
    UnsupportedVersionError,
    check_accelerate,
)

__all__ = ["redirected"]

_SWAP_LOCK = threading.RLock()


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

    def target(fsdp_plugin: Any, use_dcp: bool, directory: str) -> str | None:
        """Where a redirected sharded DCP part goes; ``None``: the stock function's job."""
        uri = redirect.uri_for(directory)
        return uri if uri is not None and _sharded_dcp(fsdp_plugin, use_dcp) else None

    def save_fsdp_model(fsdp_plugin: Any, accelerator: Any, model: Any, output_dir: str,
                        model_index: int = 0, adapter_only: bool = False,
                        use_dcp: bool = True) -> None:
        if (uri := target(fsdp_plugin, use_dcp, output_dir)) is None:
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
        if (uri := target(fsdp_plugin, use_dcp, input_dir)) is None:
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
        if (uri := target(fsdp_plugin, use_dcp, output_dir)) is None:
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
        if (uri := target(fsdp_plugin, use_dcp, input_dir)) is None:
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
