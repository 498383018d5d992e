"""Rank functions for the HF Accelerate and HF Trainer tests (run by ``mp.run_ranks``).

Accelerate and the Trainer only enable FSDP on accelerator devices; on CPU they silently
fall back to DDP (docs/integrations/accelerate.md, "Testing on CPU"). ``force_fsdp`` is the
test-only shim that makes them really run FSDP2 on a CPU gloo process group; users on GPUs
need nothing of the kind.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.utils._pytree import tree_map

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def force_fsdp(accelerator: Any, plugin: Any) -> None:
    """Test-only: turn Accelerate's silent MULTI_CPU/DDP fallback into real FSDP2 on CPU."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    accelerator.state.fsdp_plugin = plugin
    accelerator.state.distributed_type = DistributedType.FSDP
    # every AcceleratorState() re-copies PartialState's dict; it must say FSDP too
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def full_state(model: Any, optim: Any) -> dict[str, Any]:
    """The whole (unsharded) model and optimizer state, for bit-exact comparisons.

    Cloned: plain CPU tensors (``step``) come back as the optimizer's live objects, which
    the next ``optimizer.step()`` increments in place.
    """
    state = {"model": get_model_state_dict(model, options=FULL),
             "optim": get_optimizer_state_dict(model, optim, options=FULL)}
    return tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, state)


def assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), (
            f"differs at {where}: {a.flatten()[:4]} vs {b.flatten()[:4]}")
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"keys differ at {where}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"length differs at {where}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{a!r} != {b!r} at {where}"


# -- Accelerate ---------------------------------------------------------------------------


class Counter:
    """A custom object registered with ``register_for_checkpointing``."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def _accelerator(project_dir: str | None = None, total_limit: int | None = None) -> Any:
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.utils import ProjectConfiguration

    from dcpstore.integrations.accelerate import DcpstoreAccelerator

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2,
                                            state_dict_type="SHARDED_STATE_DICT",
                                            auto_wrap_policy="NO_WRAP")
    config = None
    if project_dir is not None:
        config = ProjectConfiguration(project_dir=project_dir,
                                      automatic_checkpoint_naming=True,
                                      total_limit=total_limit)
    accelerator = DcpstoreAccelerator(cpu=True, fsdp_plugin=plugin, project_config=config)
    force_fsdp(accelerator, plugin)
    return accelerator


def _prepared(accelerator: Any, seed: int = 0) -> tuple[Any, Any, Any, Counter]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 6))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.9)
    model, optim, sched = accelerator.prepare(model, optim, sched)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    return model, optim, sched, counter


def _step(accelerator: Any, model: Any, optim: Any, sched: Any, counter: Counter) -> None:
    x = torch.randn(4, 8)
    loss = model(x).pow(2).mean()
    accelerator.backward(loss)
    optim.step()
    sched.step()
    optim.zero_grad()
    counter.n += 1


def _snapshot(model: Any, optim: Any, sched: Any, counter: Counter) -> dict[str, Any]:
    return {**full_state(model, optim), "sched": dict(sched.state_dict()), "counter": counter.n,
            "rng": torch.get_rng_state()}


def accelerate_save(rank: int, world_size: int, project_uri: str, explicit: list[str]
                    ) -> dict[str, Any]:
    """Train on 2 ranks with FSDP2; automatic naming with total_limit=2 on the store;
    a failed save; resume the newest committed one bit-exact; explicit saves for later."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import dcpstore
    from dcpstore.integrations.accelerate import COMMIT_MARKER, list_checkpoints

    accelerator = _accelerator(project_uri, total_limit=2)
    assert accelerator.is_fsdp2 and accelerator.distributed_type == "FSDP"
    model, optim, sched, counter = _prepared(accelerator)
    assert all(isinstance(p, DTensor) for p in model.parameters()), "not sharded by FSDP2"

    snapshots = []
    for _ in range(3):  # checkpoint_0, _1, _2; rotation keeps _1 and _2
        _step(accelerator, model, optim, sched, counter)
        where = accelerator.save_state()
        snapshots.append(_snapshot(model, optim, sched, counter))
    root = project_uri.rstrip("/") + "/checkpoints"
    committed = [n for n, _ in list_checkpoints(root, "checkpoint_")]
    assert committed == [1, 2], committed
    assert where == root + "/checkpoint_2"
    store = dcpstore.open_backend(where)
    keys = {i.key for i in store.list()}
    assert COMMIT_MARKER in keys and "pytorch_model_fsdp_0/.metadata" in keys, keys
    assert "optimizer_0/.metadata" in keys and "custom_checkpoint_0.pkl" in keys, keys
    assert {f"random_states_{r}.pkl" for r in range(world_size)} <= keys, keys

    # a save that fails on one rank commits nothing; "latest" stays checkpoint_2
    _step(accelerator, model, optim, sched, counter)

    def fail(models: Any, weights: Any, output_dir: str) -> None:
        if rank == 1:
            raise OSError("injected failure while saving")

    handle = accelerator.register_save_state_pre_hook(fail)
    try:
        accelerator.save_state()
    except Exception as exc:  # every rank must raise
        failed = repr(exc)
    else:
        raise AssertionError("the failed save did not raise")
    handle.remove()
    assert [n for n, _ in list_checkpoints(root, "checkpoint_")] == [1, 2]
    assert list_checkpoints(root, "checkpoint_", committed=False) == []  # cleaned up
    assert accelerator.save_iteration == 3

    # resume: the newest committed one, bit-exact
    _step(accelerator, model, optim, sched, counter)
    accelerator.load_state()
    assert_same(_snapshot(model, optim, sched, counter), snapshots[2], "resume")

    # explicit directories (a store and a local path), for the resharding load
    accelerator.project_configuration.automatic_checkpoint_naming = False
    for uri in explicit:
        assert accelerator.save_state(uri) == uri

    # a mangled URI fails loudly and writes nothing locally
    cwd = os.getcwd()
    for bad in ("s3:/" + project_uri.split("://", 1)[-1], "./s3:/bucket/x"):
        try:
            accelerator.load_state(bad)
        except dcpstore.InvalidURIError:
            pass
        else:
            raise AssertionError(f"{bad!r} was accepted")
    assert not os.path.exists(os.path.join(cwd, "s3:"))
    dist.barrier()
    return {"failed": failed, "state": _snapshot(model, optim, sched, counter)}


def accelerate_load(rank: int, world_size: int, uris: list[str]) -> list[dict[str, Any]]:
    """Load checkpoints saved at another world size into a fresh model; return the state."""
    out = []
    for uri in uris:
        accelerator = _accelerator()
        model, optim, sched, counter = _prepared(accelerator, seed=123)
        accelerator.load_state(uri)
        out.append(_snapshot(model, optim, sched, counter))
        accelerator.free_memory()
    return out


# -- HF Trainer ---------------------------------------------------------------------------


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def _trainer(output_dir: str, max_steps: int, save_total_limit: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    from dcpstore.integrations.transformers import DcpstoreTrainer

    class CPUFSDPTrainer(DcpstoreTrainer):
        """Test-only: the Trainer's silent DDP fallback on CPU, turned into real FSDP2."""

        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            from accelerate import FullyShardedDataParallelPlugin

            force_fsdp(self.accelerator, FullyShardedDataParallelPlugin(
                **self.args.fsdp_plugin_args))
            self.is_fsdp_enabled = True

    class Loaded:
        """Test-only: the model and optimizer state right after a resume loaded them."""

        state: dict[str, Any] | None = None

    class RecordingTrainer(CPUFSDPTrainer):
        loaded = Loaded()

        def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
            super()._load_optimizer_and_scheduler(checkpoint)
            if checkpoint is not None:
                self.loaded.state = full_state(self.model, self.optimizer)

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=32)
    args = TrainingArguments(
        output_dir=output_dir, use_cpu=True,
        fsdp=True,  # type: ignore[arg-type]  # typed str, documented as bool or str
        fsdp_config={"version": 2, "state_dict_type": "SHARDED_STATE_DICT",
                     "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
        max_steps=max_steps, save_strategy="steps", save_steps=1,
        save_total_limit=save_total_limit, per_device_train_batch_size=2,
        learning_rate=1e-2, report_to="none", logging_strategy="no", disable_tqdm=True,
        seed=0, dataloader_num_workers=0)
    return RecordingTrainer(model=LlamaForCausalLM(config), args=args,
                            train_dataset=_Tokens())


def trainer_save_resume(rank: int, world_size: int, output_dir: str) -> dict[str, Any]:
    """2 ranks on the store: 3 steps (limit 2), then a new Trainer resumes (True) to 4."""
    from torch.distributed.tensor import DTensor

    from dcpstore.integrations.accelerate import list_checkpoints
    from dcpstore.integrations.transformers import get_last_checkpoint

    first = _trainer(output_dir, max_steps=3, save_total_limit=2)
    first.train()
    assert first.is_fsdp_enabled and all(isinstance(p, DTensor)
                                         for p in first.model.parameters())
    after_three = full_state(first.model, first.optimizer)
    assert [n for n, _ in list_checkpoints(output_dir, "checkpoint-")] == [2, 3]
    assert get_last_checkpoint(output_dir) == output_dir + "/checkpoint-3"

    second = _trainer(output_dir, max_steps=4, save_total_limit=2)
    second.train(resume_from_checkpoint=True)
    assert_same(second.loaded.state, after_three, "resume(True)")
    assert second.state.global_step == 4
    assert [n for n, _ in list_checkpoints(output_dir, "checkpoint-")] == [3, 4]
    return {"state": full_state(second.model, second.optimizer), "cwd": os.listdir(".")}


def trainer_reshard_fail(rank: int, world_size: int, source: str, output_dir: str,
                         want: dict[str, Any]) -> list[int]:
    """Another world size: resume ``source``; save to ``output_dir``; the last save fails."""
    from dcpstore.integrations.accelerate import list_checkpoints
    from dcpstore.integrations.transformers import get_last_checkpoint

    trainer = _trainer(output_dir, max_steps=6, save_total_limit=2)
    stock = trainer._save_rng_state

    def failing(checkpoint_dir: str) -> None:
        if trainer.state.global_step == 6:
            raise OSError("injected failure while saving step 6")
        stock(checkpoint_dir)

    trainer._save_rng_state = failing
    try:
        trainer.train(resume_from_checkpoint=source)
    except OSError as exc:
        assert "injected failure" in str(exc)
    else:
        raise AssertionError("the failed save did not raise")
    assert_same(trainer.loaded.state, want, "resume(uri) at another world size")
    assert list_checkpoints(output_dir, "checkpoint-", committed=False) == []
    assert get_last_checkpoint(output_dir) == output_dir + "/checkpoint-5"
    return [n for n, _ in list_checkpoints(output_dir, "checkpoint-")]
