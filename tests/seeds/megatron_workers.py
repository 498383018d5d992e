"""Rank functions of tests/seeds/test_megatron.py: a real Megatron-Core GPTModel (local,
non-TransformerEngine layer spec, tensor parallel over gloo) and its Adam state, saved and
loaded with ``megatron.core.dist_checkpointing`` and the default ``torch_dist`` strategies
while ``dcpstore.integrations.megatron.DcpstoreFeature`` is enabled.

The optimizer's sharded state dict is built the way Megatron's ``FP32Optimizer`` builds it
(``optimizer.py:1355``: ``get_param_id_to_sharded_param_map`` + ``optim_state_to_sharding_state``,
one common ``step``); the class itself allocates on CUDA (``device='cuda'`` at
``optimizer.py:1249``), as do ``DistributedDataParallel``'s buffers, so the test drives a
``torch.optim.Adam`` with Megatron's own sharding functions. A forward pass needs CUDA too
(``get_global_memory_buffer`` at ``core/utils.py:715``): gradients are drawn at random.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist

SEQ, VOCAB = 8, 64


def _build(tp: int, seed: int) -> tuple[Any, torch.optim.Optimizer]:
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(seed)
    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4,
                               use_cpu_initialization=True)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=VOCAB, max_sequence_length=SEQ)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _train(model: Any, optim: torch.optim.Optimizer, steps: int, seed: int) -> None:
    # the same draws on every rank: replicated parameters (layer norms, position
    # embeddings) stay equal across tensor-parallel ranks, as Megatron's all-reduce keeps them
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        optim.step()


def _params(optim: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    return list(itertools.chain.from_iterable(g["params"] for g in optim.param_groups))


def sharded_state(model: Any, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer as Megatron shards them (FP32Optimizer.sharded_state_dict)."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    model_sd = model.sharded_state_dict()
    optim_sd = optim.state_dict()
    steps = {float(s["step"]) for s in optim_sd["state"].values()}
    assert len(steps) == 1, steps
    id_map = get_param_id_to_sharded_param_map(model_sd, _params(optim))
    optim_state_to_sharding_state(optim_sd, id_map, exclude_keys=("step",))
    optim_sd["state"]["common_step"] = steps.pop()
    return {"model": model_sd, "optimizer": optim_sd, "iteration": 3}


def restore(model: Any, optim: torch.optim.Optimizer, loaded: dict[str, Any]) -> None:
    """Put a loaded state dict back into the model and the optimizer."""
    model.load_state_dict(loaded["model"], strict=True)
    optim_sd = loaded["optimizer"]
    step = optim_sd["state"].pop("common_step")
    for state in optim_sd["state"].values():
        state["step"] = torch.tensor(step)
    optim.load_state_dict(optim_sd)


def global_tensors(sharded: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every ShardedTensor's global value, assembled from all ranks' shards."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    mine = []
    for sh in nested_values(sharded):
        if isinstance(sh, ShardedTensor):
            assert sh.flattened_range is None
            shape = (1,) * sh.prepend_axis_num + tuple(sh.data.shape)
            local = sh.data.detach().cpu().reshape(shape)
            mine.append((sh.key, tuple(sh.global_shape), tuple(sh.global_offset), local.clone()))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out: dict[str, torch.Tensor] = {}
    for key, shape, offset, local in itertools.chain.from_iterable(everyone):
        full = out.setdefault(key, torch.full(shape, float("nan"), dtype=local.dtype))
        full[tuple(slice(o, o + n) for o, n in zip(offset, local.shape, strict=True))] = local
    return out


def save_tp2(rank: int, world: int, uris: list[str]) -> dict[str, Any]:
    """TP=2: two steps of Adam, then dist_checkpointing.save to each URI."""
    from megatron.core import dist_checkpointing

    from dcpstore.integrations.megatron import DcpstoreFeature

    DcpstoreFeature.enable()
    model, optim = _build(tp=world, seed=0)
    _train(model, optim, steps=2, seed=100)
    for uri in uris:
        dist_checkpointing.save(sharded_state(model, optim), uri)
    saved = global_tensors(sharded_state(model, optim))
    return {"tensors": saved, "step": float(optim.state_dict()["state"][0]["step"]),
            "tp_shape": tuple(model.embedding.word_embeddings.weight.shape)}


def load_tp1(rank: int, world: int, uri: str) -> dict[str, Any]:
    """TP=1 on one rank: a fresh model (other seed, one step of its own), then load."""
    from megatron.core import dist_checkpointing

    from dcpstore.integrations.megatron import DcpstoreFeature

    DcpstoreFeature.enable()
    model, optim = _build(tp=world, seed=1)
    _train(model, optim, steps=1, seed=7)  # optimizer state exists, with other values
    loaded = dist_checkpointing.load(sharded_state(model, optim), uri)
    iteration = loaded["iteration"]
    restore(model, optim, loaded)
    return {"tensors": global_tensors(sharded_state(model, optim)),
            "step": float(optim.state_dict()["state"][0]["step"]), "iteration": iteration,
            "tp_shape": tuple(model.embedding.word_embeddings.weight.shape)}


def load_model_tp(rank: int, world: int, uri: str) -> dict[str, Any]:
    """The model alone, at tensor parallelism ``world`` on the CPU, from a checkpoint saved
    at another layout (tests/gpu/test_megatron.py: TP 1 on a GPU, with the distributed
    optimizer's state beside it)."""
    from megatron.core import dist_checkpointing

    from dcpstore.integrations.megatron import DcpstoreFeature

    DcpstoreFeature.enable()
    model, _ = _build(tp=world, seed=1)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, uri)
    model.load_state_dict(loaded["model"], strict=True)
    return {"tensors": global_tensors({"model": model.sharded_state_dict()}),
            "tp_shape": tuple(model.embedding.word_embeddings.weight.shape)}


def fsdp_dtensor_plain_optimizer_state(rank: int, world: int, uri: str) -> str:
    """Megatron-Bridge's ``fsdp_dtensor`` save (``save_fsdp_dtensor_checkpoint``:
    ``torch.distributed.checkpoint.save(state_dict, storage_writer=...)``) with the
    Megatron-FSDP failure: parameters are DTensors, but the optimizer hands its state over
    as plain per-rank tensors (each rank's local shard). Megatron-FSDP itself needs CUDA
    (``megatron_fsdp.py:234``), so the DTensors come from torch's own API. Returns the error.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import dcpstore

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    weight = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    key = "module.decoder.layers.0.mlp.linear_fc1.weight"
    state = {
        "model": {key: weight},
        "optimizer": {"state": {key: {"exp_avg": weight.to_local().clone() * 0.1,
                                      "step": torch.tensor(3.0)}}},
    }
    try:
        dcp.save(state, storage_writer=dcpstore.get_writer(uri))
    except BaseException as exc:  # torch's CheckpointException is a BaseException
        return f"{type(exc).__name__}: {exc}"
    return "saved"
