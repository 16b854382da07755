"""Fixed step costs (`dflash bench --fixed-step-costs`): "auto" chooses widths from one table, not from its timing."""

import json
import math
import random

import pytest
import torch
from conftest import make_drafter, make_target, random_prompt

from transformers_dflash import bench, decoding
from transformers_dflash.bench.fixed_costs import (
    FixedCostDraftLength,
    StepCosts,
    drafter_shape,
    measure_step_costs,
)
from transformers_dflash.bench.metrics import Sample, relative_rate, summarize
from transformers_dflash.draft_length import AutoDraftLength

pytestmark = pytest.mark.usefixtures("one_thread")


def _models():
    target = make_target("llama", vocab_size=97, eos_token_id=96)
    with torch.no_grad():
        target.lm_head.weight[96] = 0  # greedy runs never stop early
    return target, make_drafter(target, num_layers=1, block_size=4)


def _costs(drafter, verify=(0.010, 0.012, 0.013, 0.014), draft=0.003):
    return StepCosts(list(verify), {drafter_shape(drafter): draft})


def test_step_costs_table_file_and_bad_input(tmp_path):
    costs = StepCosts([0.01, 0.015, 0.02], {"shape": 0.004})
    assert costs.verify(2) == 0.015 and costs.verify(5) == pytest.approx(0.03)  # the last two widths' line beyond
    (tmp_path / "costs.json").write_text(json.dumps(costs.to_dict()))
    assert StepCosts.load(tmp_path / "costs.json") == costs
    (tmp_path / "report.json").write_text(json.dumps({"settings": {"fixed_step_costs": costs.to_dict()}}))
    assert StepCosts.load(tmp_path / "report.json") == costs
    (tmp_path / "other.json").write_text(json.dumps({"settings": {"dtype": "float32"}}))
    with pytest.raises(ValueError, match="holds no step costs"):
        StepCosts.load(tmp_path / "other.json")
    with pytest.raises(ValueError, match="no step-cost file"):
        StepCosts.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="positive verify_seconds"):
        StepCosts([0.01, 0.0])
    with pytest.raises(ValueError, match="no draft cost for a drafter of shape"):
        costs.draft(_models()[1])


def test_fixed_cost_policy_chooses_from_the_table_and_models_the_time():
    costs = StepCosts([0.010, 0.012, 0.013, 0.030], {})
    policy = FixedCostDraftLength(costs, draft_seconds=0.002)
    confidence = torch.tensor([[0.9, 0.8, 0.5]])
    # Expected tokens per second of k drafts: (1 + sum of the cumulative confidences) / (draft + verify(k + 1)).
    cumulative = [0.9, 0.72, 0.36]
    rates = [1 / 0.012] + [(1 + sum(cumulative[:k])) / (0.002 + costs.verify(k + 1)) for k in (1, 2, 3)]
    assert policy.num_to_verify(confidence) == max(range(4), key=rates.__getitem__) == 2
    policy.record(3, seconds=9.0, draft_seconds=5.0, accepted=torch.tensor([2]))  # measured times are ignored
    policy.record(1, seconds=7.0)
    assert policy.modelled_seconds == pytest.approx(0.013 + 0.002 + 0.010)
    assert policy.step_costs(4) == [0.010, 0.012, 0.013, 0.030]
    assert policy.num_to_verify(confidence) == 2  # unchanged by what was measured


def _copy_references(monkeypatch, references):
    """Drafts copied from the target's own greedy continuations, with every third slot (by position) wrong: partial
    accepts that depend on the position only, never on how often the drafter ran."""
    from transformers_dflash.candidate_generator import DFlashCandidateGenerator

    following = {}
    for ref in references:
        for pos in range(len(ref) - 1):
            following.setdefault((pos, ref[pos]), ref[pos + 1 :])
    original = DFlashCandidateGenerator.draft

    def draft(generator, anchor_ids, anchor_position_ids, *args, **kwargs):
        drafts, confidence = original(generator, anchor_ids, anchor_position_ids, *args, **kwargs)
        for row in range(drafts.shape[0]):
            pos = int(anchor_position_ids[row])
            cont = following.get((pos, int(anchor_ids[row])), [])[: drafts.shape[1]]
            for j, token in enumerate(cont):
                drafts[row, j] = token if (pos + j) % 3 else (token + 1) % 96
        if confidence is not None:  # confident enough that verifying the drafts pays
            confidence = torch.full_like(confidence, 0.8)
        return drafts, confidence

    monkeypatch.setattr(DFlashCandidateGenerator, "draft", draft)


def test_fixed_costs_make_the_choices_independent_of_timing(monkeypatch):
    """With step times that jump at random, "auto" verifies different widths from run to run; with fixed costs
    every run takes the same steps. Every output equals plain generate()'s."""
    target, drafter = _models()
    prompts = [random_prompt(10, seed=s) for s in (0, 1)]
    references = [target.generate(p, max_new_tokens=24, do_sample=False)[0].tolist() for p in prompts]
    _copy_references(monkeypatch, references)
    noise = random.Random(0)
    clock = [0.0]

    def jittery_clock():
        clock[0] += noise.choice([0.001, 0.05])
        return clock[0]

    monkeypatch.setattr(decoding, "step_clock", jittery_clock)

    def run(step_costs):
        report = bench.run_benchmark(
            target,
            drafter,
            datasets={"tiny": [p[0].tolist() for p in prompts]},
            methods=["dflash_adaptive"],
            temperatures=(0.0,),
            max_new_tokens=24,
            repeats=2,
            progress=False,
            step_costs=step_costs,
        )
        assert report["mismatches"] == []
        return report, [s["acceptance"] for s in report["samples"] if s["method"] == "dflash_adaptive"]

    costs = _costs(drafter)
    first, steps = run(costs)
    assert run(costs)[1] == steps
    assert any(n > 1 for run_steps in steps for n in run_steps[1:])  # drafts were accepted
    assert first["settings"]["fixed_step_costs"] == costs.to_dict()
    rows = {r["method"]: r for r in first["summary"]}
    assert math.isfinite(rows["dflash_adaptive"]["modelled_speedup"]) and rows["baseline"]["modelled_speedup"] == 1.0
    # The baseline's modelled time: one width-1 step per token after the prefill's.
    base = [s for s in first["samples"] if s["method"] == "baseline"]
    assert all(s["modelled_seconds"] == pytest.approx((s["new_tokens"] - 1) * 0.010) for s in base)
    measured = {json.dumps(run(None)[1]) for _ in range(4)}
    assert len(measured) > 1, "the timing noise did not move 'auto' at all: the test shows nothing"


def test_measure_step_costs_in_the_decoding_loop():
    target, drafter = _models()
    other = make_drafter(target, num_layers=2, block_size=4, seed=3)
    ids = random_prompt(8, seed=0)
    kwargs = dict(max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    costs = measure_step_costs(target, [drafter, other], ids, kwargs, block_size=4, rounds=1)
    assert len(costs.verify_seconds) == 4 and all(s > 0 for s in costs.verify_seconds)
    assert costs.verify_seconds == sorted(costs.verify_seconds)  # never cheaper than a narrower width
    assert set(costs.draft_seconds) == {drafter_shape(drafter), drafter_shape(other)}
    assert drafter.draft_length is None and drafter.draft_length_memory == {}  # settings restored


def test_modelled_rates_in_the_summary_and_comparisons():
    def sample(method, modelled, tokens=10):
        return Sample(method, "d", 0.0, 0, 0, 5, tokens, 1.0, [1] + [3] * 3, modelled_seconds=modelled)

    rows = summarize([sample("baseline", 0.9), sample("a", 0.3), sample("b", 0.45), sample("c", None)])
    by = {r["method"]: r for r in rows}
    assert by["a"]["modelled_speedup"] == pytest.approx(3.0) and by["b"]["modelled_speedup"] == pytest.approx(2.0)
    assert math.isnan(by["c"]["modelled_speedup"])
    (row,) = relative_rate(rows, "a", "b")
    assert row["modelled_ratio"] == pytest.approx(1.5)


def test_cli_fixed_step_costs(tmp_path, capsys):
    from transformers_dflash.cli import build_parser

    common = ["bench", "--quick", "--threads", "1", "--num-prompts", "1", "--max-new-tokens", "12"]
    common += ["--temperatures", "0", "--warmup", "0", "--no-progress", "--methods", "dflash_defaults"]
    args = build_parser().parse_args(common + ["--fixed-step-costs", "--output-dir", str(tmp_path / "a")])
    assert args._dflash_run(args) == 0
    out = capsys.readouterr().out
    assert "fixed step costs (ms)" in out and "modelled speedup" in out
    first = json.loads((tmp_path / "a" / "bench.json").read_text())
    assert len(first["settings"]["fixed_step_costs"]["verify_seconds"]) == 4
    # Reusing the costs of that report: the same steps, step for step.
    reuse = ["--fixed-step-costs", str(tmp_path / "a" / "bench.json"), "--output-dir", str(tmp_path / "b")]
    args = build_parser().parse_args(common + reuse)
    assert args._dflash_run(args) == 0
    second = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert second["settings"]["fixed_step_costs"] == first["settings"]["fixed_step_costs"]

    def steps(report):
        return [(s["acceptance"], s["modelled_seconds"]) for s in report["samples"]]

    assert steps(second) == steps(first)
    # A costs file that lacks a drafter's shape: that draft cost is measured and added, the rest kept.
    shapeless = dict(first["settings"]["fixed_step_costs"], draft_seconds={})
    (tmp_path / "shapeless.json").write_text(json.dumps(shapeless))
    args = build_parser().parse_args(
        common + ["--fixed-step-costs", str(tmp_path / "shapeless.json"), "--output-dir", str(tmp_path / "d")]
    )
    assert args._dflash_run(args) == 0
    filled = json.loads((tmp_path / "d" / "bench.json").read_text())["settings"]["fixed_step_costs"]
    assert filled["verify_seconds"] == shapeless["verify_seconds"] and len(filled["draft_seconds"]) == 1
    for bad, message in (
        (["--fixed-step-costs", str(tmp_path / "none.json")], "no step-cost file"),
        (["--fixed-step-costs", "--batch-sizes", "1,2"], "per-prompt benchmark"),
    ):
        args = build_parser().parse_args(common + bad + ["--output-dir", str(tmp_path / "c")])
        with pytest.raises(SystemExit, match=message):
            args._dflash_run(args)


def test_auto_policy_is_still_the_one_used_without_fixed_costs():
    target, drafter = _models()
    memory = {}
    drafter.draft_length, drafter.draft_length_memory = "auto", memory
    ids = random_prompt(8, seed=1)
    target.generate(ids, assistant_model=drafter, max_new_tokens=6, do_sample=False)
    assert any(type(p) is AutoDraftLength for p in memory.values())
