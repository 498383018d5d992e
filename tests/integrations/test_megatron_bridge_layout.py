"""Megatron-Bridge's ``fsdp_dtensor`` checkpoint layout through dcpstore, reproduced with plain
torch (tests/integrations/bridge_workers.py), because Megatron-Bridge 0.6 cannot be imported
here (docs/integrations/megatron.md): 2 ranks with FSDP2 save ``iter_*`` directories and the
tracker to SeaweedFS, 1 rank resumes the iteration the tracker names, bit-exact.

PhysicsNeMo, Megatron-Core and AReaL run for real, through their own checkpoint code, in
tests/seeds/ (``make test-seeds``).
"""

from __future__ import annotations

import pytest
from bridge_workers import TRACKER, bridge_load, bridge_save
from hf_workers import assert_same
from mp import run_ranks

import dcpstore

pytestmark = pytest.mark.multiprocess


def test_megatron_bridge_layout_on_s3(s3_root: str) -> None:
    root = f"{s3_root}/megatron"
    saved = run_ranks(bridge_save, 2, root, timeout=400)[0]
    store = dcpstore.open_backend(root)
    assert store.get(TRACKER) == b"20"
    assert store.exists("iter_0000010/.metadata") and store.exists("iter_0000020/.metadata")

    loaded = run_ranks(bridge_load, 1, root, timeout=400)[0]
    assert loaded["iteration"] == 20
    assert_same(loaded["state"], saved, "megatron")
    assert_same(loaded["weights"], saved["model"], "dcp weights")
