"""Rank functions of tests/gpu/test_megatron.py: Megatron's GPU-only paths on dcpstore.

On a CPU, Megatron-Core's forward pass, its ``DistributedDataParallel`` and its optimizers,
and all of Megatron-FSDP stop at ``torch.cuda`` calls (docs/integrations/megatron.md). Here
they run on the rank's GPU, over NCCL:

- a ``GPTModel`` (local layer spec) in Megatron's ``DistributedDataParallel`` with the
  distributed optimizer from ``get_megatron_optimizer``, trained on real batches and saved
  with ``dist_checkpointing`` (``torch_dist``) while ``DcpstoreFeature`` is enabled;
- the same model under Megatron-FSDP's ``fully_shard`` with ``torch.optim.Adam``: parameters
  and optimizer states are DTensors, saved the way Megatron-Bridge saves ``fsdp_dtensor``
  checkpoints (``torch.distributed.checkpoint.save`` with a ``storage_writer``).

Each save is loaded into a fresh model and optimizer (other seed, one step of their own) and
compared bit-exact; then both runs train one more step and must compute the same loss. The
values as saved go to ``want.pt`` for the reshard checks on CPU ranks (:func:`load_resharded`
here, ``load_model_tp`` in tests/seeds/megatron_workers.py).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# the seed test's rank functions (tests/seeds): the CPU side of the reshards
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "seeds"))

SEQ, VOCAB, BATCH = 8, 64, 4  # the seed test's model sizes (tests/seeds/megatron_workers.py)

__all__ = ["ddp_resume", "ddp_save", "fsdp_resume", "fsdp_save", "load_resharded"]


# --- Megatron-Core GPTModel on the GPU -------------------------------------------------------

def _gpt(seed: int) -> Any:
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    # bit-exact training continuation: deterministic kernels where torch has them
    torch.use_deterministic_algorithms(True, warn_only=True)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=1)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4,
                               hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=VOCAB, max_sequence_length=SEQ)
    return model.cuda()


def _batch(step: int) -> tuple[torch.Tensor, ...]:
    """Batch ``step`` of a fixed synthetic token stream (the same in every process)."""
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    position_ids = torch.arange(SEQ).expand(BATCH, SEQ)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    return tuple(t.cuda() for t in (tokens[:, :-1], position_ids, causal, tokens[:, 1:]))


def _loss(model: Any, step: int) -> torch.Tensor:
    input_ids, position_ids, mask, labels = _batch(step)
    return model(input_ids, position_ids, mask, labels=labels).float().mean()


def _tensors(state: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """``(dotted key, tensor)`` for every tensor in a nested dict, keyed as DCP keys them."""
    if isinstance(state, torch.Tensor):
        yield prefix, state
    elif isinstance(state, dict):
        for k, v in state.items():
            yield from _tensors(v, f"{prefix}.{k}" if prefix else str(k))


def _cpu_values(state: Any) -> dict[str, torch.Tensor]:
    """Every tensor's global value on the CPU (a DTensor's ``full_tensor``)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for key, t in _tensors(state):
        full = t.full_tensor() if isinstance(t, DTensor) else t
        out[key] = full.detach().cpu().clone()
    return out


def _differences(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    wrong = sorted(set(got) ^ set(want))
    return wrong + [k for k in sorted(set(got) & set(want))
                    if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]


# --- Megatron-Core DDP + distributed optimizer + dist_checkpointing ----------------------------

def _ddp(seed: int) -> tuple[Any, Any]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    gpt = _gpt(seed)
    ddp = DistributedDataParallel(
        config=gpt.config, module=gpt,
        ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                 grad_reduce_in_fp32=True))
    optim = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True,
                        clip_grad=1.0), [ddp])
    return ddp, optim


def _ddp_step(ddp: Any, optim: Any, step: int) -> float:
    ddp.zero_grad_buffer()
    optim.zero_grad()
    loss = _loss(ddp, step)
    loss.backward()
    ddp.finish_grad_sync()
    result = optim.step()
    assert (result[0] if isinstance(result, tuple) else result), "Megatron skipped the step"
    return float(loss.item())


def _inner(optim: Any) -> list[Any]:
    """The ``torch.optim`` optimizers inside a Megatron optimizer (chained or not)."""
    return [o.optimizer for o in getattr(optim, "chained_optimizers", [optim])]


def _ddp_state(ddp: Any, optim: Any) -> dict[str, torch.Tensor]:
    """The model's parameters and every Adam moment, in the optimizer's order (the ``step``
    counters: :func:`_steps`)."""
    out = {f"model.{k}": v.detach().cpu().clone()
           for k, v in ddp.module.state_dict().items() if isinstance(v, torch.Tensor)}
    for c, inner in enumerate(_inner(optim)):
        params = [p for g in inner.param_groups for p in g["params"]]
        for i, p in enumerate(params):
            for name, value in inner.state[p].items():
                if name != "step":
                    out[f"optim.{c}.{i}.{name}"] = value.detach().cpu().clone()
    return out


def _steps(optim: Any) -> list[float]:
    """The distinct Adam ``step`` counters of the optimizer's parameters."""
    return sorted({float(s["step"]) for inner in _inner(optim) for s in inner.state.values()})


def _group_steps(state: Any) -> set[float]:
    """The ``step`` of every optimizer param group in a (loaded) state dict."""
    if not isinstance(state, dict):
        return set()
    found = {float(g["step"]) for g in state.get("param_groups", []) if "step" in g}
    for value in state.values():
        found |= _group_steps(value)
    return found


#: The distributed optimizer's checkpoint format: Megatron-LM's default (``dp_reshardable``,
#: unless ``--dist-ckpt-optim-fully-reshardable``). The others fail in megatron-core 0.19.2
#: on the GPU, before or after dcpstore: ``fully_sharded_model_space`` (the class's default)
#: at save, "ShardedTensor.flattened_range is not supported"; ``fully_reshardable`` at load
#: with torch's AdamW (no TransformerEngine or Apex), ``KeyError: 'step'`` in
#: ``_set_main_param_and_optimizer_states`` (distrib_optimizer.py:1223).
_SHARDING = {"distrib_optim_sharding_type": "dp_reshardable"}


def _ddp_sharded(ddp: Any, optim: Any, *, loading: bool) -> dict[str, Any]:
    # Megatron's save_checkpoint unwraps DDP first: the keys are the GPTModel's own
    model_sd = ddp.module.sharded_state_dict(metadata=_SHARDING)
    return {"model": model_sd, "iteration": 2,
            "optimizer": optim.sharded_state_dict(model_sd, is_loading=loading,
                                                  metadata=_SHARDING)}


def ddp_save(rank: int, world: int, uri: str, want_path: str) -> dict[str, Any]:
    """Two training steps, ``dist_checkpointing.save`` to ``uri``, then a third step."""
    from megatron.core import dist_checkpointing

    from dcpstore.integrations.megatron import DcpstoreFeature

    DcpstoreFeature.enable()
    ddp, optim = _ddp(seed=0)
    losses = [_ddp_step(ddp, optim, step) for step in range(2)]
    dist_checkpointing.save(_ddp_sharded(ddp, optim, loading=False), uri)
    saved = _ddp_state(ddp, optim)
    if rank == 0:
        import megatron_workers  # tests/seeds: the CPU reshard's view of the same model

        torch.save(megatron_workers.global_tensors({"model": ddp.module.sharded_state_dict()}),
                   want_path)
    return {"state": saved, "steps": _steps(optim), "losses": losses,
            "next_loss": _ddp_step(ddp, optim, 2),
            "inner": [type(o).__name__ for o in getattr(optim, "chained_optimizers", [optim])]}


def ddp_resume(rank: int, world: int, uri: str) -> dict[str, Any]:
    """A fresh model and optimizer (seed 1, one step), ``dist_checkpointing.load``, one step."""
    from megatron.core import dist_checkpointing

    from dcpstore.integrations.megatron import DcpstoreFeature

    DcpstoreFeature.enable()
    ddp, optim = _ddp(seed=1)
    _ddp_step(ddp, optim, step=7)  # optimizer state exists, with other values
    loaded = dist_checkpointing.load(_ddp_sharded(ddp, optim, loading=True), uri)
    ddp.module.load_state_dict(loaded["model"], strict=True)
    # fp32 parameters: the distributed optimizer's main parameters are views of the model's
    # leaf parameters, which megatron-core 0.19.2 copies into in place outside no_grad
    # ("a view of a leaf Variable that requires grad is being used in an in-place operation",
    # distrib_optimizer.py:1225); bf16 training has separate fp32 main parameters
    with torch.no_grad():
        optim.load_state_dict(loaded["optimizer"])
    # The step a checkpoint keeps is its param groups' (Megatron's no-TE/Apex path). With
    # torch's AdamW, megatron-core 0.19.2 first sets every parameter's step from it, then
    # overwrites it with the loading optimizer's own: dp_reshardable keeps "step" as a
    # LocalNonpersistentObject (distrib_optimizer.py:1946), so the value that comes back is the
    # one handed in at load. Set it as Megatron's first pass did (TE's and Apex's FusedAdam
    # keep the step in the param groups and never meet this).
    persisted = _group_steps(loaded["optimizer"])
    after_load = _steps(optim)
    for inner in _inner(optim):
        for state in inner.state.values():
            state["step"] = torch.tensor(max(persisted), dtype=torch.float32)
    return {"state": _ddp_state(ddp, optim), "iteration": loaded["iteration"],
            "persisted_steps": sorted(persisted), "steps_after_load": after_load,
            "steps": _steps(optim), "next_loss": _ddp_step(ddp, optim, 2)}


# --- Megatron-FSDP: DTensor parameters and optimizer states ------------------------------------

def _fsdp(seed: int) -> tuple[Any, torch.optim.Optimizer]:
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from megatron_fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh

    gpt = _gpt(seed)
    # Megatron's layers are tensor-parallel aware: Megatron-FSDP wants a TP dimension, of
    # size 1 here ("you must specify tp_dim", megatron_fsdp/utils.py)
    mesh = init_device_mesh("cuda", (dist.get_world_size(), 1), mesh_dim_names=("dp", "tp"))
    optim = torch.optim.Adam(gpt.parameters(), lr=1e-2)
    model, optim = fully_shard(gpt, optim, device_mesh=mesh, dp_shard_dim="dp", tp_dim="tp",
                               fsdp_unit_modules=[TransformerLayer], zero_dp_strategy=3,
                               device=torch.device("cuda", torch.cuda.current_device()))
    return model, optim


def _fsdp_step(model: Any, optim: torch.optim.Optimizer, step: int) -> float:
    optim.zero_grad()
    loss = _loss(model, step)
    loss.backward()
    optim.step()
    return float(loss.item())


def _fsdp_state(model: Any, optim: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": optim.state_dict()}


def _plain_moments(state: dict[str, Any]) -> list[str]:
    """Optimizer moments that are not DTensors (Megatron-FSDP must hand over DTensors)."""
    from torch.distributed.tensor import DTensor

    return [k for k, t in _tensors(state["optimizer"])
            if k.rsplit(".", 1)[-1] in ("exp_avg", "exp_avg_sq") and not isinstance(t, DTensor)]


def fsdp_save(rank: int, world: int, uri: str, want_path: str) -> dict[str, Any]:
    """Two steps, Megatron-Bridge's ``fsdp_dtensor`` save (plain DCP, dcpstore's writer),
    then a third step."""
    import torch.distributed.checkpoint as dcp

    import dcpstore

    model, optim = _fsdp(seed=0)
    losses = [_fsdp_step(model, optim, step) for step in range(2)]
    state = _fsdp_state(model, optim)
    dcp.save(state, storage_writer=dcpstore.get_writer(uri))
    saved = _cpu_values(state)
    if rank == 0:
        torch.save(saved, want_path)
    return {"state": saved, "losses": losses, "plain_moments": _plain_moments(state),
            "moments": sum(k.endswith(".exp_avg") for k in saved),
            "next_loss": _fsdp_step(model, optim, 2)}


def fsdp_resume(rank: int, world: int, uri: str) -> dict[str, Any]:
    """A fresh Megatron-FSDP model and optimizer (seed 1, one step), plain DCP load with
    dcpstore's reader (Bridge's path when ``DcpstoreFeature`` is enabled), one step."""
    import torch.distributed.checkpoint as dcp

    import dcpstore

    model, optim = _fsdp(seed=1)
    _fsdp_step(model, optim, step=7)
    state = _fsdp_state(model, optim)
    dcp.load(state, storage_reader=dcpstore.get_reader(uri))
    model.load_state_dict(state["model"])
    optim.load_state_dict(state["optimizer"])
    return {"state": _cpu_values(_fsdp_state(model, optim)),
            "next_loss": _fsdp_step(model, optim, 2)}


# --- the reshard: every tensor of a GPU checkpoint on CPU ranks -------------------------------

def load_resharded(rank: int, world: int, uri: str, want_path: str) -> list[str]:
    """Load every tensor of the checkpoint at ``uri`` on ``world`` CPU ranks, each as a
    DTensor sharded on its first dimension over them, and compare with ``want_path``.

    Returns the keys compared; raises naming any value that differs.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    import dcpstore

    metadata = dcpstore.get_reader(uri).read_metadata()
    mesh = init_device_mesh("cpu", (world,))
    state: dict[str, Any] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            empty = torch.full(tuple(meta.size), float("nan")).to(meta.properties.dtype)
            state[key] = distribute_tensor(empty, mesh, [Shard(0)]) if empty.dim() else empty
    dcpstore.load(state, uri)
    got = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}
    want = torch.load(want_path)
    missing = sorted(set(want) - set(got))
    assert not missing, f"saved on the GPU but not in the checkpoint: {missing}"
    wrong = _differences({k: got[k] for k in want}, want)
    assert not wrong, f"resharded onto {world} CPU ranks, these differ: {wrong}"
    return sorted(want)

