"""scripts/tau_curve.py: the data subsets it trains on and the table it reports (the runs themselves are real
training and benchmark commands, tested with their own modules)."""

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "tau_curve.py"


@pytest.fixture(scope="module")
def tau_curve():
    spec = importlib.util.spec_from_file_location("tau_curve", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _features(folder, num_shards):
    folder.mkdir()
    for i in range(num_shards):
        (folder / f"shard-{i:05d}.pt").write_bytes(b"x")
    (folder / "features.json").write_text("{}")
    return folder


def test_subset_links_the_first_shards(tau_curve, tmp_path):
    features = _features(tmp_path / "features", 3)
    [folder] = tau_curve.subset([features], tmp_path / "curve", 2)
    assert sorted(p.name for p in folder.iterdir()) == ["features.json", "shard-00000.pt", "shard-00001.pt"]
    assert (folder / "shard-00001.pt").resolve() == (features / "shard-00001.pt").resolve()
    assert tau_curve.subset([features], tmp_path / "curve", 2) == [folder]  # a rerun keeps the links
    with pytest.raises(SystemExit, match="hold 3 feature shards; --shards asks for 4"):
        tau_curve.subset([features], tmp_path / "curve", 4)


def test_subset_takes_the_folders_in_order(tau_curve, tmp_path):
    first, second = _features(tmp_path / "regenerated", 2), _features(tmp_path / "replies", 3)
    assert tau_curve.subset([first, second], tmp_path / "curve", 1) == [tmp_path / "curve" / "data-1" / "0"]
    folders = tau_curve.subset([first, second], tmp_path / "curve", 4)
    assert folders == [tmp_path / "curve" / "data-4" / "0", tmp_path / "curve" / "data-4" / "1"]
    assert sorted(p.name for p in folders[1].iterdir()) == ["features.json", "shard-00000.pt", "shard-00001.pt"]
    assert (folders[1] / "features.json").resolve() == (second / "features.json").resolve()


def test_report_tabulates_finished_evaluations(tau_curve, tmp_path):
    out = tmp_path / "curve"
    (out / "run-2").mkdir(parents=True)
    (out / "eval").mkdir()
    start = {"event": "start", "step": 0, "total_steps": 400, "num_examples": 500, "config": {"batch_size": 8}}
    (out / "run-2" / "log.jsonl").write_text(json.dumps(start) + "\n" + json.dumps({"step": 10, "loss": 5.0}) + "\n")
    (out / "run-2.json").write_text(json.dumps({"cpu_s": 2400.0, "wall_s": 2600.0}))
    for step, tau in [(200, 1.1), (400, 1.2)]:
        summary = [
            {"dataset": name, "method": method, "tau": 1.0 if method == "baseline" else tau + offset, "mismatches": 0}
            for name, offset in [("mtbench", 0.02), ("humaneval", -0.02), ("all", 0.0)]
            for method in ("baseline", "dflash")  # plain decoding's rows are left out of the table
        ]
        samples = [
            {"method": "dflash", "acceptance": [1, 1, 2, 1] if step == 200 else [1, 2]},
            {"method": "dflash", "acceptance": [2, 1, 1, 1, 1]},
            {"method": "baseline", "acceptance": None},
        ]
        evaluation = {"summary": summary, "samples": samples} if step == 400 else {"summary": summary}
        (out / "eval" / f"run-2-step-{step}.json").write_text(json.dumps(evaluation))
    table = tau_curve.report(argparse.Namespace(out=out)).splitlines()
    assert table[2:] == [
        "| 2 | 500 | 200 | 3.2 | 20 | 1.12 | 1.08 | 1.10 | ? |",
        "| 2 | 500 | 400 | 6.4 | 40 | 1.22 | 1.18 | 1.20 | 1.20-1.50 |",
    ]
