"""The HF Trainer (transformers 5.x) with FSDP2 sharded checkpoints on dcpstore.

A tiny Llama built from a config in code (no hub). Launch 1: 2 ranks save every step to
SeaweedFS with ``save_total_limit=2``, then a new Trainer resumes with
``resume_from_checkpoint=True`` bit-exact. Launch 2: 1 rank resumes that S3 checkpoint by
URI into a local ``output_dir`` and its last save fails: the previous one stays the latest.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_workers import trainer_reshard_fail, trainer_save_resume
from mp import run_ranks

from dcpstore.integrations.accelerate import is_committed

pytestmark = pytest.mark.multiprocess


def test_trainer_fsdp2_s3_rotation_resume(s3_root: str, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a mangled URI would show up here as ./s3:
    output_dir = f"{s3_root}/trainer"
    saved = run_ranks(trainer_save_resume, 2, output_dir, timeout=500)
    assert "s3:" not in saved[0]["cwd"] and not (tmp_path / "s3:").exists()
    assert is_committed(f"{output_dir}/checkpoint-4")

    local = str(tmp_path / "local-run")
    kept = run_ranks(trainer_reshard_fail, 1, f"{output_dir}/checkpoint-4", local,
                     saved[0]["state"], timeout=500)[0]
    assert kept == [5]
    assert not (Path(local) / "checkpoint-6").exists()


def test_trainer_refuses_a_mangled_output_dir(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import TrainingArguments

    import dcpstore
    from dcpstore.integrations.transformers import DcpstoreTrainer

    monkeypatch.chdir(tmp_path)
    args = TrainingArguments(output_dir="s3:/bucket/run", use_cpu=True, report_to="none")
    with pytest.raises(dcpstore.InvalidURIError, match="collapsed"):
        DcpstoreTrainer(model=None, args=args)
    assert list(tmp_path.iterdir()) == []
