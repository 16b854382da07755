"""scripts/gpu_pipeline_smollm2.py: the pieces that decide step counts and what comes back (its stages are `dflash`
commands, tested with their own modules; the whole script ran on an H200, docs/training.md)."""

import argparse
import json

import pytest
import torch
from conftest import load_script
from safetensors.torch import load_file, save_file


@pytest.fixture(scope="module")
def pipeline():
    return load_script("gpu_pipeline_smollm2")


def _pipeline(module, tmp_path):
    args = argparse.Namespace(work=str(tmp_path / "work"), out=str(tmp_path / "out"), budget=100, target="smollm2")
    return module.Pipeline(args)


def test_probe_rate_leaves_out_the_warm_up(pipeline, tmp_path):
    run = tmp_path / "probe"
    run.mkdir()
    records = [{"event": "start"}, {"step": 10, "train_seconds": 8.0}, {"step": 20, "train_seconds": 10.0}]
    (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert _pipeline(pipeline, tmp_path).steps_per_second(run) == pytest.approx(5.0)  # not 20 / 10


def test_export_keeps_token_ids_exact(pipeline, tmp_path):
    """bfloat16 for the weights only: the draft vocabulary's ids would round (49151 -> 49152)."""
    p = _pipeline(pipeline, tmp_path)
    checkpoint = tmp_path / "work" / "ft2" / "checkpoint-00000010"
    checkpoint.mkdir(parents=True)
    ids = torch.tensor([5, 49151], dtype=torch.int64)
    save_file({"fc.weight": torch.randn(4, 4), "draft_vocab_ids": ids}, checkpoint / "model.safetensors")
    (checkpoint / "config.json").write_text(json.dumps({"dtype": "float32"}))
    (tmp_path / "work" / "ft2" / "log.jsonl").write_text("{}\n")
    p.summary["runs"] = {"ft2": {}}
    p.export(["ft2"])  # no final drafter: its last checkpoint
    weights = load_file(tmp_path / "out" / "ft2" / "model.safetensors")
    assert weights["fc.weight"].dtype == torch.bfloat16 and torch.equal(weights["draft_vocab_ids"], ids)
    assert json.loads((tmp_path / "out" / "ft2" / "config.json").read_text())["dtype"] == "bfloat16"
    assert (tmp_path / "out" / "ft2" / "log.jsonl").exists()
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["runs"]["ft2"]["exported_from"] == "ft2/checkpoint-00000010"
