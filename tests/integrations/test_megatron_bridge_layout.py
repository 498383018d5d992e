"""The seeds' own systems (PhysicsNeMo, AReaL, Megatron-Bridge): their checkpoint call
patterns through dcpstore, reproduced with plain torch (tests/integrations/seed_workers.py).

None of the three installs beside torch 2.13 and this project's pins (see
docs/integrations/README.md, "The seeds' own systems", for the commands and errors), so
these tests pin down that what each system does with its checkpoint directory works on a
dcpstore URI: 2 ranks with FSDP2 save to SeaweedFS, 1 rank resumes bit-exact.
"""

from __future__ import annotations

import pytest
from hf_workers import assert_same
from mp import run_ranks
from seed_workers import TRACKER, seeds_load, seeds_save

import dcpstore

pytestmark = pytest.mark.multiprocess


def test_seed_system_patterns_on_s3(s3_root: str) -> None:
    roots = {name: f"{s3_root}/{name}" for name in ("physicsnemo", "areal", "megatron")}
    saved = run_ranks(seeds_save, 2, roots, timeout=400)[0]

    pnemo = {i.key for i in dcpstore.open_backend(roots["physicsnemo"]).list()}
    assert pnemo == {"Sequential.0.0.pt", "Sequential.0.1.pt", "checkpoint.0.0.pt",
                     "checkpoint.0.1.pt", "weights/FullyConnected.0.1.mdlus"}
    areal = dcpstore.open_backend(roots["areal"])
    assert areal.exists(".metadata") and areal.exists("recover_info.pkl")
    megatron = dcpstore.open_backend(roots["megatron"])
    assert megatron.get(TRACKER) == b"20"
    assert megatron.exists("iter_0000010/.metadata") and megatron.exists("iter_0000020/.metadata")

    loaded = run_ranks(seeds_load, 1, roots, timeout=400)[0]
    for name in ("physicsnemo", "areal", "megatron"):
        assert_same(loaded[name], saved[name], name)
    for name in ("Sequential.0.1.pt", "weights/FullyConnected.0.1.mdlus"):
        assert_same(loaded[name], saved["physicsnemo"]["model"], name)
    assert_same(loaded["megatron_weights"], saved["megatron"]["model"], "dcp weights")
    assert loaded["areal_info"] == {"global_step": 2, "epoch": 0, "dataloader": {"idx": 8}}
    assert loaded["megatron_iteration"] == 20
