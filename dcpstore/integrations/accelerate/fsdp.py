"""Accelerate's ``fsdp_utils`` save/load functions, redirected: within
:func:`redirected`, DCP parts addressed to a local scratch directory stream to the
checkpoint URI through dcpstore."""

from __future__ import annotations

import contextlib
import functools
import inspect
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
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    replacements: dict[str, Callable[..., Any]] = {}

    def replaces(name: str, directory: str) -> Callable[[Callable[..., Any]], None]:
        """Make ``fn(uri, args)`` stand in for fsdp_utils' ``name``, called with its
        arguments by name, where its ``directory`` argument is redirected to ``uri`` and
        the part is sharded DCP; anything else goes to the stock function."""
        stock = getattr(fsdp_utils, name)
        signature = inspect.signature(stock)

        def register(fn: Callable[..., Any]) -> None:
            @functools.wraps(stock)
            def call(*args: Any, **kwargs: Any) -> Any:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                given = bound.arguments
                uri = redirect.uri_for(given[directory])
                if uri is None or not _sharded_dcp(given["fsdp_plugin"], given["use_dcp"]):
                    return stock(*args, **kwargs)
                return fn(uri, given)

            replacements[name] = call
        return register

    def save(part: str, state: dict[str, Any]) -> None:
        dcp.save(state, storage_writer=dcpstore.get_writer(part, overwrite=True))

    def load(part: str, state: dict[str, Any]) -> None:
        dcp.load(state, storage_reader=dcpstore.get_reader(part))

    @replaces("save_fsdp_model", "output_dir")
    def _(uri: str, a: dict[str, Any]) -> None:
        os.makedirs(a["output_dir"], exist_ok=True)  # the local stand-in, as the stock does
        options = fsdp_utils._prepare_sd_options(a["fsdp_plugin"])
        model = fsdp_utils._get_model_state_dict(a["model"], adapter_only=a["adapter_only"],
                                                 sd_options=options)
        save(_sub(uri, FSDP_MODEL_NAME, a["model_index"]), {"model": model})

    @replaces("load_fsdp_model", "input_dir")
    def _(uri: str, a: dict[str, Any]) -> Any:
        a["accelerator"].wait_for_everyone()
        options = fsdp_utils._prepare_sd_options(a["fsdp_plugin"])
        state = {"model": fsdp_utils._get_model_state_dict(
            a["model"], adapter_only=a["adapter_only"], sd_options=options)}
        load(_sub(uri, FSDP_MODEL_NAME, a["model_index"]), state)
        result = fsdp_utils._set_model_state_dict(a["model"], state["model"],
                                                  adapter_only=a["adapter_only"],
                                                  sd_options=options)
        a["accelerator"].wait_for_everyone()
        return result

    @replaces("save_fsdp_optimizer", "output_dir")
    def _(uri: str, a: dict[str, Any]) -> None:
        os.makedirs(a["output_dir"], exist_ok=True)
        options = fsdp_utils._prepare_sd_options(a["fsdp_plugin"])
        optimizer = get_optimizer_state_dict(a["model"], a["optimizer"], options=options)
        save(_sub(uri, OPTIMIZER_NAME, a["optimizer_index"]), {"optimizer": optimizer})

    @replaces("load_fsdp_optimizer", "input_dir")
    def _(uri: str, a: dict[str, Any]) -> None:
        a["accelerator"].wait_for_everyone()
        options = fsdp_utils._prepare_sd_options(a["fsdp_plugin"])
        state = {"optimizer": get_optimizer_state_dict(a["model"], a["optimizer"],
                                                       options=options)}
        load(_sub(uri, OPTIMIZER_NAME, a["optimizer_index"]), state)
        set_optimizer_state_dict(a["model"], a["optimizer"], state["optimizer"],
                                 options=options)
        a["accelerator"].wait_for_everyone()

    assert set(replacements) == set(_FSDP_FUNCTIONS), replacements
    return replacements


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
