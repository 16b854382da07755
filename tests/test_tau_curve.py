"""scripts/tau_curve.py: the data subsets it trains on and the table it reports (the runs themselves are real
training and benchmark commands, tested with their own modules)."""

import argparse
import json
from pathlib import Path

import pytest
from conftest import load_script


@pytest.fixture(scope="module")
def tau_curve():
    return load_script("tau_curve")


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


def test_report_of_replayed_evaluations(tau_curve, tmp_path):
    out = tmp_path / "curve"
    (out / "run-4").mkdir(parents=True)
    (out / "eval").mkdir()
    start = {"event": "start", "step": 0, "total_steps": 800, "num_examples": 1000, "config": {"batch_size": 8}}
    (out / "run-4" / "log.jsonl").write_text(json.dumps(start) + "\n")
    (out / "run-4.json").write_text(json.dumps({"cpu_s": 4800.0, "wall_s": 5000.0}))
    for step, tau in [(800, 1.4), (400, 1.3)]:
        sets = {"mt-F": {"tau": tau + 0.05}, "he-F": {"tau": tau - 0.05}}
        result = [{"drafter": "x", "sets": sets, "tau": tau, "interval": [tau - 0.02, tau + 0.03]}]
        (out / "eval" / f"run-4-step-{step}.replay.json").write_text(json.dumps(result))
    (out / "eval" / "run-4-step-400.json").write_text("{}")  # a bench evaluation is not read
    table = tau_curve.report(argparse.Namespace(out=out, val_features=[Path("mt-F"), Path("he-F")])).splitlines()
    assert table[0] == (
        "| shards | training sequences | steps | epochs | training CPU-min | tau mt-F | tau he-F | tau all (95 % interval) |"
    )
    assert table[2:] == [
        "| 4 | 1000 | 400 | 3.2 | 40 | 1.350 | 1.250 | 1.300 (1.280-1.330) |",
        "| 4 | 1000 | 800 | 6.4 | 80 | 1.450 | 1.350 | 1.400 (1.380-1.430) |",
    ]


@pytest.fixture(scope="module")
def heldout_tau():
    return load_script("heldout_tau")


def test_heldout_tau_pools_steps_and_brackets_them(heldout_tau):
    per_prompt = [[1, 2, 1], [3, 1], [1, 1, 1, 1]]
    assert heldout_tau.pooled_tau(per_prompt) == 12 / 9
    low, high = heldout_tau.bootstrap_interval(per_prompt)
    assert 1.0 <= low <= 12 / 9 <= high <= 2.0
    assert heldout_tau.bootstrap_interval([[2, 2], [2]]) == (2.0, 2.0)  # every resample pools to the same tau
    sets = {"mt": {"tau": 1.5, "tau_all_anchors": 1.4, "slot_accuracy": [0.4, 0.2]}}
    table = heldout_tau.table([{"drafter": "d", "sets": sets, "tau": 1.5, "interval": (1.45, 1.55)}]).splitlines()
    assert table[2] == "| d | 1.500 | 1.500 (1.450-1.550) | 1.400 | 0.400 |  |"


def test_heldout_tau_paired_difference(heldout_tau):
    reference = [[1, 1, 1], [2, 1], [1, 1, 1, 1]]
    better = [[2, 1], [3], [2, 2]]  # every prompt gains
    difference, (low, high) = heldout_tau.paired_difference(better, reference)
    assert difference == pytest.approx(10 / 5 - 10 / 9)  # the same 10 tokens in 5 steps instead of 9
    assert 0 < low <= difference <= high
    assert heldout_tau.paired_difference(reference, reference) == (0.0, (0.0, 0.0))
    with pytest.raises(ValueError, match="same prompts"):
        heldout_tau.paired_difference(better[:2], reference)
    sets = {"mt": {"tau": 1.0, "tau_all_anchors": 1.0, "slot_accuracy": [0.1]}}
    rows = [
        {"drafter": name, "sets": sets, "tau": 1.0, "interval": (1.0, 1.0), "acceptance_lengths": lengths}
        for name, lengths in (("ref", reference), ("new", better))
    ]
    assert heldout_tau.table(rows).splitlines()[3].endswith(f"| {difference:+.3f} ({low:+.3f} to {high:+.3f}) |")


def test_heldout_tau_pools_anchors_over_sets(heldout_tau):
    sets = {
        "mt": {"tau": 1.5, "tau_all_anchors": 1.2, "slot_accuracy": [0.2], "anchors": 300},
        "he": {"tau": 1.5, "tau_all_anchors": 1.6, "slot_accuracy": [0.4], "anchors": 100},
    }
    row = heldout_tau.table([{"drafter": "d", "sets": sets, "tau": 1.5, "interval": (1.4, 1.6)}]).splitlines()[2]
    assert "| 1.300 | 0.250 |" in row  # (300 x 1.2 + 100 x 1.6) / 400 anchors; (300 x 0.2 + 100 x 0.4) / 400
