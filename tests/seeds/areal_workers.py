"""Rank functions of tests/seeds/test_areal.py: AReaL's own ``FSDPEngine`` (a tiny Qwen2 made
here, no hub), its SFT loss and its recover flow (``RecoverHandler``, ``RecoverInfo``,
``check_if_auto_recover``, ``Saver``'s paths), run on gloo ranks with
``dcpstore.integrations.areal`` enabled and ``fileroot`` on SeaweedFS.

Every rank works in its own empty directory (``cwd``), so a local ``s3:`` directory that
AReaL made for a URI would be found there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

EXPERIMENT, TRIAL = "areal-seed", "trial0"
#: rows per rank in the dataloader, and its batch size
ROWS, BATCH = 8, 2
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def make_tiny_qwen2(path: str) -> None:
    """A 2-layer Qwen2 config and a word-level tokenizer: what AReaL's engine reads from
    ``config.path`` (``init_from_scratch`` makes the weights)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2} | {f"w{i}": i + 3 for i in range(61)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(path)
    Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                tie_word_embeddings=False, eos_token_id=1, pad_token_id=0).save_pretrained(path)


def _enter(cwd: str) -> None:
    os.makedirs(cwd, exist_ok=True)
    os.chdir(cwd)
    from dcpstore.integrations import areal as dcpstore_areal

    dcpstore_areal.enable()


def _engine(model_dir: str, world: int, seed: int) -> Any:
    from areal.api.cli_args import OptimizerConfig, TrainEngineConfig
    from areal.engine.fsdp_engine import FSDPEngine

    torch.manual_seed(seed)
    engine = FSDPEngine(TrainEngineConfig(
        experiment_name=EXPERIMENT, trial_name=TRIAL, path=model_dir, backend=f"fsdp:d{world}",
        attn_impl="sdpa", init_from_scratch=True, dtype="float32",
        optimizer=OptimizerConfig(lr=1e-2)))
    engine.create_process_group()
    engine.initialize(None, _ft_spec())
    return engine


def _ft_spec() -> Any:
    from areal.api.io_struct import FinetuneSpec

    return FinetuneSpec(total_train_epochs=1, dataset_size=ROWS * 2, train_batch_size=BATCH)


def _train_step(engine: Any, step: int) -> None:
    """One SFT step through AReaL's ``train_batch`` and its own packed SFT loss."""
    from areal.trainer.sft.lm_engine import compute_packed_sft_loss

    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    input_ids = torch.randint(3, 64, (2, 12), generator=gen)
    attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
    attention_mask[1, 9:] = False
    loss_mask = attention_mask.clone()
    loss_mask[:, :3] = False
    engine.train()
    stats = engine.train_batch(
        input_={"input_ids": input_ids, "attention_mask": attention_mask,
                "loss_mask": torch.roll(loss_mask, shifts=-1, dims=-1)},
        loss_fn=compute_packed_sft_loss,
        loss_weight_fn=lambda x: x["loss_mask"].count_nonzero())
    assert stats["update_successful"] == 1.0, stats


def full_state(engine: Any) -> dict[str, Any] | None:
    """Model and optimizer state as full CPU tensors by parameter name: a collective,
    called on every rank; rank 0 gets the state, the others ``None``."""
    model, optim = get_state_dict(engine.model, engine.optimizer, options=FULL)
    return {"model": model, "optim": optim} if dist.get_rank() == 0 else None


@dataclass
class _StatsLogger:
    """AReaL's ``StatsLogger`` contributes ``state_dict()`` to the recover info; the real
    one starts wandb / tensorboard, which has nothing to do with checkpoints."""

    step: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def _recover_parts(fileroot: str) -> tuple[Any, Any, Any, Any, Any]:
    """AReaL's RecoverHandler, Saver and Evaluator, a stats logger and a per-rank dataloader."""
    from areal.api.cli_args import EvaluatorConfig, RecoverConfig, SaverConfig
    from areal.utils.evaluator import Evaluator
    from areal.utils.recover import RecoverHandler
    from areal.utils.saver import Saver
    from torchdata.stateful_dataloader import StatefulDataLoader

    names = {"experiment_name": EXPERIMENT, "trial_name": TRIAL, "fileroot": fileroot}
    spec = _ft_spec()
    handler = RecoverHandler(RecoverConfig(mode="auto", freq_steps=1, **names), spec)
    saver = Saver(SaverConfig(freq_steps=100, **names), spec)
    evaluator = Evaluator(EvaluatorConfig(freq_steps=100, **names), spec)
    start = dist.get_rank() * ROWS
    loader = StatefulDataLoader(list(range(start, start + ROWS)), batch_size=BATCH)
    return handler, saver, evaluator, _StatsLogger(), loader


def recover_config(fileroot: str) -> Any:
    from areal.api.cli_args import RecoverConfig

    return RecoverConfig(mode="auto", experiment_name=EXPERIMENT, trial_name=TRIAL,
                         fileroot=fileroot)


def recover_checkpoint_uri(fileroot: str) -> str:
    from areal.utils.saver import Saver

    return Saver.get_recover_checkpoint_path(EXPERIMENT, TRIAL, fileroot)


def save_run(rank: int, world: int, fileroot: str, model_dir: str, cwd: str,
             guard_uri: str) -> dict[str, Any]:
    """Train 2 steps, dumping AReaL's recover checkpoint and info after each (the second
    dump replaces the first); then the bad inputs that need an engine."""
    from areal.api import SaveLoadMeta, StepInfo
    from areal.utils.recover import check_if_auto_recover

    from dcpstore.errors import ShardingError
    from dcpstore.integrations.areal import LocalFilesOnlyError

    _enter(os.path.join(cwd, f"rank{rank}"))
    if rank == 0 and not os.path.exists(os.path.join(model_dir, "config.json")):
        make_tiny_qwen2(model_dir)
    out: dict[str, Any] = {"auto_recover_before": check_if_auto_recover(
        recover_config(fileroot))}
    dist.barrier()
    engine = _engine(model_dir, world, seed=0)
    handler, saver, evaluator, stats, loader = _recover_parts(fileroot)
    batches = iter(loader)
    for step in range(2):
        out.setdefault("batches", []).append(next(batches).tolist())
        _train_step(engine, step)
        stats.step = step + 1
        info = StepInfo(epoch=0, epoch_step=step, global_step=step,
                        steps_per_epoch=_ft_spec().steps_per_epoch)
        handler.dump(engine, info, saver, evaluator, stats, loader)
    out["state"] = full_state(engine)
    out["saver_state"] = saver.state_dict()
    out["next_batch"] = next(batches).tolist()

    # an HF export to a URI would be local files: refused, nothing written
    try:
        engine.save(SaveLoadMeta(path=f"{fileroot}/hf", weight_format="hf", with_optim=False))
    except LocalFilesOnlyError as exc:
        out["hf_error"] = str(exc)
    # a per-rank plain tensor where a DTensor belongs: dcpstore's sharding guard refuses it
    engine.model.register_buffer("per_rank_stat", torch.arange(rank + 1.0))
    try:
        engine.save(SaveLoadMeta(path=guard_uri, weight_format="dcp", with_optim=False))
    except (Exception, CheckpointException) as exc:  # DCP wraps the coordinator's error
        out["guard_error"] = f"{type(exc).__name__}: {exc}"
        out["guard_is_sharding_error"] = isinstance(exc, ShardingError) or (
            "ShardingError" in str(exc))
    return out


def recover_run(rank: int, world: int, fileroot: str, model_dir: str,
                cwd: str) -> dict[str, Any]:
    """A new run: AReaL's auto-recover check on the store, then ``RecoverHandler.load``
    into a new engine (seeded differently)."""
    from areal.utils.recover import check_if_auto_recover

    _enter(os.path.join(cwd, f"rank{rank}"))
    out: dict[str, Any] = {"auto_recover": check_if_auto_recover(recover_config(fileroot))}
    engine = _engine(model_dir, world, seed=1)
    before = full_state(engine)
    out["before"] = before["model"] if before else None
    handler, saver, evaluator, stats, loader = _recover_parts(fileroot)
    info = handler.load(engine, saver, evaluator, stats, loader)
    assert info is not None, "RecoverHandler.load found no recover info"
    out["global_step"] = info.last_step_info.global_step
    out["next_step"] = info.last_step_info.next().global_step
    out["stats_step"] = stats.step
    out["saver_state"] = saver.state_dict()
    out["next_batch"] = next(iter(loader)).tolist()
    out["state"] = full_state(engine)
    return out


def reshard_run(rank: int, world: int, fileroot: str, model_dir: str,
                cwd: str) -> dict[str, Any]:
    """The recover checkpoint of 2 ranks loaded by ``FSDPEngine.load`` on ``world`` ranks."""
    from areal.api import SaveLoadMeta

    _enter(os.path.join(cwd, f"rank{rank}"))
    engine = _engine(model_dir, world, seed=2)
    engine.load(SaveLoadMeta(path=recover_checkpoint_uri(fileroot), weight_format="dcp",
                             with_optim=True))
    return {"state": full_state(engine)}
