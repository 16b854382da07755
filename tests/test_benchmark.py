"""`dflash bench` (transformers_dflash.bench): the report arithmetic on hand-made numbers, the mismatch check, the
built-in drafter conversion, and a quick end-to-end run on tiny random models."""

import json
import math

import pytest
import torch
from conftest import make_drafter, make_target, random_prompt

from transformers_dflash import bench
from transformers_dflash.bench import Method, Sample

BUILTIN, BUILTIN_REASON = bench.builtin_dflash_available()
needs_builtin = pytest.mark.skipif(not BUILTIN, reason=BUILTIN_REASON)


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread


# ---------------------------------------------------------------------------------------------------------------------
# Arithmetic


def test_rates_speedup_and_tpot():
    assert bench.tokens_per_second(120, 4.0) == 30.0
    assert bench.time_per_output_token_ms(120, 4.0) == pytest.approx(33.333, abs=1e-3)
    assert bench.speedup(90.0, 30.0) == 3.0
    assert math.isnan(bench.tokens_per_second(10, 0.0))
    assert math.isnan(bench.time_per_output_token_ms(0, 1.0))
    assert math.isnan(bench.speedup(10.0, 0.0))
    assert math.isnan(bench.speedup(math.nan, 10.0))


def test_tau_histogram_and_r():
    runs = [[1, 3, 1, 5], [1, 2, 16], [1]]  # prefill entries (the leading 1s) are excluded
    assert bench.acceptance_steps(runs[0]) == [3, 1, 5]
    assert bench.mean_acceptance_length(runs) == pytest.approx((3 + 1 + 5 + 2 + 16) / 5)
    assert bench.acceptance_histogram(runs) == {1: 1, 2: 1, 3: 1, 5: 1, 16: 1}
    assert bench.acceptance_histogram(runs, max_length=4) == {1: 1, 2: 1, 3: 1, 4: 2}
    assert math.isnan(bench.mean_acceptance_length([[1], []]))
    # r = tau / speedup: the published reference (tau 6.49, speedup 4.86) gives 1.34
    assert bench.overhead_ratio(6.49, 4.86) == pytest.approx(1.335, abs=1e-3)
    assert math.isnan(bench.overhead_ratio(2.0, 0.0))


def _sample(method, seconds, tokens, acceptance=None, output=None, dataset="d", index=0, temperature=0.0):
    output = output if output is not None else list(range(tokens))
    return Sample(method, dataset, temperature, index, 0, 10, tokens, seconds, acceptance, output)


def test_summarize_rows():
    samples = [
        _sample("baseline", 2.0, 20),
        _sample("baseline", 2.0, 20, index=1),
        _sample("fast", 1.0, 20, acceptance=[1, 4, 4, 4, 4, 3]),
        _sample("fast", 1.0, 20, acceptance=[1, 1, 5, 5, 5, 3], index=1),
        _sample("baseline", 1.0, 10, dataset="e"),
        _sample("fast", 2.0, 10, acceptance=[1, 1, 1, 1, 1, 1, 1, 1, 1, 1], dataset="e"),
        _sample("baseline", 1.0, 10, temperature=1.0),
        _sample("fast", 0.5, 12, acceptance=[1, 6, 5], temperature=1.0),
    ]
    rows = {(r["temperature"], r["dataset"], r["method"]): r for r in bench.summarize(samples, max_length=6)}
    fast = rows[(0.0, "d", "fast")]
    assert fast["tokens_per_s"] == 20.0 and fast["tpot_ms"] == 50.0
    assert fast["speedup"] == 2.0  # 40 tokens / 2 s against 40 tokens / 4 s
    assert fast["tau"] == pytest.approx(38 / 10)
    assert fast["acceptance_histogram"] == {1: 1, 2: 0, 3: 2, 4: 4, 5: 3, 6: 0}
    assert fast["r"] == pytest.approx(3.8 / 2.0)
    assert fast["prompts"] == 2 and fast["runs"] == 2 and fast["mismatches"] == 0
    base = rows[(0.0, "d", "baseline")]
    assert base["speedup"] == 1.0 and base["tau"] == 1.0 and base["r"] == 1.0
    slow = rows[(0.0, "e", "fast")]
    assert slow["speedup"] == 0.5 and slow["tau"] == 1.0 and slow["r"] == 2.0
    # "all" pools both datasets: 50 tokens / 4 s against 50 tokens / 5 s
    assert rows[(0.0, "all", "fast")]["speedup"] == pytest.approx(1.25)
    assert rows[(0.0, "all", "fast")]["tau"] == pytest.approx((38 + 9) / 19)
    sampled = rows[(1.0, "d", "fast")]
    assert sampled["speedup"] == pytest.approx(24 / 10) and sampled["tau"] == 5.5
    assert (1.0, "all", "fast") in rows


def test_speedup_per_repeat_pairs_each_repeat_with_the_baseline_runs_beside_it():
    def run(method, seconds, repeat, index=0):
        return Sample(method, "d", 0.0, index, repeat, 10, 20, seconds, [1, 2] if method != "baseline" else None)

    samples = [run("baseline", 2.0, k) for k in range(3)] + [run("baseline", 2.0, k, index=1) for k in range(3)]
    samples += [run("fast", s, k) for k, s in enumerate((1.0, 0.5, 2.0))]
    samples += [run("fast", 1.0, k, index=1) for k in range(3)]
    samples += [run("other", 2.0, k) for k in range(3)] + [run("other", 2.0, k, index=1) for k in range(3)]
    rows = {r["method"]: r for r in bench.summarize(samples)}
    # repeat k: 40 tokens in (seconds of prompt 0 + 1 s) against 40 tokens in 4 s
    assert rows["fast"]["speedup_per_repeat"] == pytest.approx([2.0, 4 / 1.5, 4 / 3])
    assert rows["baseline"]["speedup_per_repeat"] == [1.0, 1.0, 1.0]
    assert bench.median_and_range(rows["fast"]["speedup_per_repeat"]) == pytest.approx((2.0, 4 / 3, 4 / 1.5))
    assert all(math.isnan(v) for v in bench.median_and_range([math.nan]))
    (ratio,) = bench.relative_rate(list(rows.values()), "fast", "other")
    assert ratio["ratio_per_repeat"] == pytest.approx([2.0, 4 / 1.5, 4 / 3])


def test_relative_rate():
    rows = bench.summarize(
        [_sample("baseline", 2.0, 20), _sample("dflash", 1.0, 20, [1, 2]), _sample("builtin_dflash", 1.5, 20, [1, 2])]
    )
    (ratio,) = bench.relative_rate(rows, "dflash", "builtin_dflash")
    assert ratio["ratio"] == pytest.approx(1.5) and ratio["tau"] == 2.0


def test_report_command_reads_as_the_dflash_command_it_ran():
    from transformers_dflash.bench.report import command_line

    module = "/x/src/transformers_dflash/cli/__main__.py"  # argv[0] of `python -m transformers_dflash.cli`
    assert command_line([module, "bench", "--name", "a b"]) == "dflash bench --name 'a b'"
    assert command_line(["/venv/bin/dflash", "bench"]) == "dflash bench"
    assert command_line(["scripts/ab.py", "--rounds", "3"]) == "scripts/ab.py --rounds 3"


def test_find_mismatches_flags_only_greedy_differences():
    samples = [
        _sample("baseline", 1.0, 4, output=[5, 6, 7, 8]),
        _sample("same", 1.0, 4, output=[5, 6, 7, 8]),
        _sample("wrong", 1.0, 4, output=[5, 6, 9, 8]),
        _sample("short", 1.0, 3, output=[5, 6, 7]),
        _sample("baseline", 1.0, 4, output=[1, 1, 1, 1], temperature=1.0),
        _sample("sampled", 1.0, 4, output=[2, 2, 2, 2], temperature=1.0),  # sampling is never compared
    ]
    found = {m["method"]: m for m in bench.find_mismatches(samples)}
    assert set(found) == {"wrong", "short"}
    assert found["wrong"]["first_difference"] == 2 and found["short"]["first_difference"] == 3
    assert bench.first_difference([1, 2], [1, 2]) is None


def test_prompt_selection_and_draft_length_parsing():
    assert bench.select_prompts(list("abcdefghij"), 3, "first") == ([0, 1, 2], ["a", "b", "c"])
    assert bench.select_prompts(list("abcdefghij"), 3, "spread") == ([0, 3, 6], ["a", "d", "g"])
    assert bench.select_prompts(list("abc"), 5)[0] == [0, 1, 2]
    assert bench.parse_draft_length("auto") == "auto" and bench.parse_draft_length("none") == "full"
    assert bench.parse_draft_length("0.4") == 0.4
    with pytest.raises(ValueError):
        bench.parse_draft_length("1.5")


def test_markdown_from_hand_made_report():
    samples = [_sample("baseline", 2.0, 20), _sample("dflash", 1.0, 20, [1, 4, 4, 4, 4, 4])]
    report = {
        "settings": {
            "datasets": {"d": 1},
            "max_new_tokens": 20,
            "repeats": 1,
            "warmup": 1,
            "seed": 0,
            "block_size": 16,
        },
        "environment": {"device": "cpu", "torch_threads": 1},
        "methods": {"baseline": {"label": "plain", "note": ""}, "dflash": {"label": "ours", "note": ""}},
        "summary": bench.summarize(samples),
        "mismatches": [],
        "notes": [bench.UNTRAINED_NOTE],
    }
    text = bench.format_markdown(report)
    assert "| d | ours | 20.0 | 50.0 | 2.00x | 4.00 | 2.00 | 20 | 0 |" in text
    assert "UNTRAINED" in text and "every method's output equals" in text
    assert "- chat template kwargs: none (the template's defaults)" in text  # a report without the setting
    report["settings"]["chat_template_kwargs"] = {"enable_thinking": False}
    assert '- chat template kwargs: `{"enable_thinking": false}`' in bench.format_markdown(report)


# ---------------------------------------------------------------------------------------------------------------------
# Tiny models


def _scaled_drafter(target, block_size=5):
    drafter = make_drafter(target, num_layers=2, block_size=block_size)
    with torch.no_grad():  # larger weights: varied proposals rather than one token repeated
        for p in drafter.parameters():
            if p.dim() > 1:
                p.mul_(5.0)
    return drafter


@needs_builtin
def test_builtin_drafter_computes_our_drafter_function():
    """Forward-level equivalence of the converted drafter over two steps: a prefill's context, then 3 new context
    rows (an anchor + 2 accepted drafts), each with the block's keys/values dropped from the cache afterwards."""
    from transformers.cache_utils import DFlashCache

    from transformers_dflash import DFlashDrafterCache

    target = make_target("llama")  # float64
    drafter = _scaled_drafter(target)
    builtin = bench.to_builtin_drafter(drafter)
    assert sorted(bench.builtin_state_dict(drafter.state_dict())) == sorted(builtin.state_dict())
    block, hidden = drafter.config.block_size, drafter.config.hidden_size
    features = len(drafter.config.target_layer_ids) * hidden
    g = torch.Generator().manual_seed(0)
    ours_cache, their_cache = DFlashDrafterCache(drafter.config.num_hidden_layers), DFlashCache(config=builtin.config)
    start = 0
    for step, new in enumerate((9, 3)):
        context = torch.randn(1, new, features, generator=g, dtype=torch.float64)
        embeds = torch.randn(1, block, hidden, generator=g, dtype=torch.float64)
        context_pos = torch.arange(start, start + new)[None]
        block_pos = torch.arange(start + new, start + new + block)[None]
        ours = drafter(
            block_embeddings=embeds,
            context_features=context,
            block_position_ids=block_pos,
            context_position_ids=context_pos,
            cache=ours_cache,
        ).last_hidden_state
        their_cache.set_previous_accepted_tokens(new)
        if step:
            their_cache.crop(-block)
        theirs = builtin(
            noise_embeds=embeds,
            context_hidden_states=context,
            position_ids=torch.cat([context_pos, block_pos], dim=1),
            cache=their_cache,
        ).last_hidden_state
        torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-9)
        start += new


@needs_builtin
def test_builtin_path_proposes_exactly_our_drafts():
    target = make_target("llama", vocab_size=12, eos_token_id=None)  # small vocabulary: some drafts get accepted
    drafter = _scaled_drafter(target)
    builtin = bench.to_builtin_drafter(drafter)
    for seed in range(2):
        prompt = torch.randint(3, 12, (1, 9), generator=torch.Generator().manual_seed(seed))
        check = bench.compare_drafts(target, drafter, builtin, prompt, max_new_tokens=30)
        assert check["all_equal"] and check["outputs_equal"], (seed, check)
        assert check["steps_compared"] >= 20 and check["ours_acceptance"] == check["builtin_acceptance"]


def test_comparisons_must_name_methods_that_run():
    target = make_target("llama", vocab_size=97)
    with pytest.raises(ValueError, match="comparisons must be .*baseline, dflash.*which names nowhere"):
        bench.run_benchmark(
            target,
            make_drafter(target, num_layers=1, block_size=4),
            datasets={"tiny": [[5, 6, 7]]},
            methods=["dflash"],
            comparisons=[("dflash", "nowhere")],
            progress=False,
        )


def test_quick_run_flags_injected_mismatch_and_writes_reports(tmp_path):
    # EOS is an extra vocabulary row whose logit is always 0: greedy runs never stop early. (eos_token_id=None would
    # do too, but prompt lookup in transformers 4.57 crashes without an EOS id.)
    target = make_target("llama", vocab_size=97, eos_token_id=96)
    with torch.no_grad():
        target.lm_head.weight[96] = 0
    drafter = make_drafter(target, num_layers=1, block_size=4)
    prompts = [random_prompt(10, seed=s)[0].tolist() for s in (0, 1)]

    def wrong(ids, kwargs):  # a "method" whose greedy output differs from the target's at the third new token
        out = target.generate(ids, **kwargs).clone()
        if not kwargs["do_sample"]:
            out[0, ids.shape[1] + 2] = (out[0, ids.shape[1] + 2] + 1) % 96
        return out, None

    report = bench.run_benchmark(
        target,
        drafter,
        datasets={"tiny": prompts},
        methods=bench.DEFAULT_METHODS,
        extra_methods=[Method("wrong", "broken method", wrong)],
        comparisons=[("wrong", "dflash")],
        temperatures=(0.0, 1.0),
        max_new_tokens=12,
        progress=False,
        drafter_trained=False,
    )
    flagged = {(m["method"], m["prompt_index"]) for m in report["mismatches"]}
    assert flagged == {("wrong", 0), ("wrong", 1)}
    assert all(m["first_difference"] == 2 for m in report["mismatches"])
    rows = {(r["temperature"], r["method"]): r for r in report["summary"]}
    assert rows[(0.0, "wrong")]["mismatches"] == 2 and rows[(0.0, "dflash")]["mismatches"] == 0
    assert rows[(0.0, "baseline")]["speedup"] == 1.0
    for method in ("dflash", "dflash_adaptive", "prompt_lookup") + (("builtin_dflash",) if BUILTIN else ()):
        assert rows[(0.0, method)]["tau"] >= 1.0 and rows[(0.0, method)]["r"] > 0
        assert sum(rows[(0.0, method)]["acceptance_histogram"].values()) > 0
    asked = [c for c in report["comparisons"] if (c["method"], c["other"]) == ("wrong", "dflash")]
    assert len(asked) == 1 and {r["temperature"] for r in asked[0]["rows"]} == {0.0, 1.0}
    assert asked[0]["rows"] == bench.relative_rate(report["summary"], "wrong", "dflash")
    if BUILTIN:
        assert report["draft_check"]["all_equal"]
        assert {(c["method"], c["other"]) for c in report["comparisons"]} >= {("dflash", "builtin_dflash")}
    else:
        assert "builtin_dflash" in report["skipped"]
    assert len(report["samples"]) == 2 * 2 * len(report["settings"]["methods"])

    paths = bench.write_report(report, tmp_path)
    data = json.loads(paths["json"].read_text())
    assert data["environment"]["torch_threads"] == 1 and "transformers" in data["environment"]
    assert "git" in data["environment"]
    markdown = paths["markdown"].read_text()
    assert "broken method" in markdown and "Greedy outputs that differ" in markdown
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "png" not in paths
    else:
        assert paths["png"].stat().st_size > 1000


def test_cli_quick_mode(tmp_path, capsys):
    from transformers_dflash.cli import build_parser

    args = build_parser().parse_args(
        [
            "bench",
            "--quick",
            "--threads",
            "1",
            "--num-prompts",
            "1",
            "--max-new-tokens",
            "8",
            "--temperatures",
            "0",
            "--warmup",
            "0",
            "--no-progress",
            "--output-dir",
            str(tmp_path),
            "--methods",
            "dflash,prompt_lookup",
        ]
    )
    assert args._dflash_run(args) == 0
    out = capsys.readouterr().out
    assert "DFlash (transformers-dflash)" in out and "prompt lookup" in out
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["settings"]["methods"] == ["baseline", "dflash", "prompt_lookup"]
    assert data["mismatches"] == []


@needs_builtin
def test_builtin_drafter_keeps_rope_frequencies_in_float32():
    target = make_target("llama", dtype=torch.bfloat16)
    builtin = bench.to_builtin_drafter(make_drafter(target))
    assert next(builtin.parameters()).dtype == torch.bfloat16
    assert builtin.rotary_emb.inv_freq.dtype == torch.float32


# ---------------------------------------------------------------------------------------------------------------------
# Batched throughput


def test_batch_helpers():
    ids, mask = bench.left_pad([torch.tensor([5, 6, 7]), torch.tensor([[9]])], pad_token_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    new = torch.tensor([[4, 2, 0, 0], [4, 4, 4, 4], [2, 0, 0, 0]])
    assert bench.generated_lengths(new, [2]) == [2, 4, 1]
    # Two rows: prefill entries (first of each list) are left out.
    assert bench.batch_acceptance_length([[1, 3, 1], [1, 2]]) == pytest.approx((3 + 1 + 2) / 3)
    assert math.isnan(bench.batch_acceptance_length([[1], [1]]))
    assert bench.batch_acceptance_length([1, 4, 2]) == 3.0  # batch of one: a flat list


def test_batch_benchmark_rows_match_plain_generate():
    target = make_target("llama", dtype=torch.float32)
    drafter = make_drafter(target, block_size=4)
    prompts = [random_prompt(6 + 3 * i, seed=i)[0] for i in range(3)]
    rows = bench.run_batch_benchmark(
        target,
        drafter,
        prompts,
        batch_sizes=(1, 4),
        max_new_tokens=12,
        warmup=0,
        adaptive_draft_length="auto",
        progress=False,
    )
    assert [(r["batch_size"], r["method"]) for r in rows] == [
        (b, m) for b in (1, 4) for m in ("baseline", "dflash", "dflash_adaptive")
    ]
    assert all(r["rows_equal"] for r in rows)
    for b in (1, 4):
        base, ours = [r for r in rows if r["batch_size"] == b][:2]
        assert ours["tokens"] == base["tokens"] and base["speedup"] == pytest.approx(1.0)
        assert ours["speedup"] == pytest.approx(ours["tokens_per_s"] / base["tokens_per_s"])
        assert ours["tau"] >= 1.0
    assert drafter.draft_length is None  # restored


def test_cli_batch_mode(tmp_path, capsys):
    from transformers_dflash.cli import build_parser

    args = build_parser().parse_args(
        [
            "bench",
            "--quick",
            "--threads",
            "1",
            "--num-prompts",
            "2",
            "--max-new-tokens",
            "6",
            "--warmup",
            "0",
            "--no-progress",
            "--output-dir",
            str(tmp_path),
            "--batch-sizes",
            "1,3",
        ]
    )
    assert args._dflash_run(args) == 0
    assert "batched throughput" in capsys.readouterr().out
    data = json.loads((tmp_path / "bench-batch.json").read_text())
    assert [r["batch_size"] for r in data["rows"]] == [1, 1, 1, 3, 3, 3]
    with pytest.raises(SystemExit, match="--batch-sizes"):
        bad = build_parser().parse_args(["bench", "--quick", "--threads", "1", "--batch-sizes", "0,x"])
        bad._dflash_run(bad)


def test_kernel_attribution_methods_match_plain_generate():
    """baseline_skinny / prompt_lookup_skinny / dflash_stock_linears: the same tokens, other linear kernels."""
    target = make_target("qwen3", dtype=torch.float32)
    drafter = make_drafter(target, num_layers=1, block_size=4)
    prompts = [random_prompt(8, seed=s)[0].tolist() for s in (0, 1)]
    names = ("baseline", "baseline_skinny", "prompt_lookup_skinny", "dflash_stock_linears")
    report = bench.run_benchmark(
        target,
        drafter,
        datasets={"tiny": prompts},
        methods=names,
        temperatures=(0.0,),
        max_new_tokens=10,
        progress=False,
        drafter_trained=False,
    )
    # transformers 4.x's prompt lookup can return more than max_new_tokens (it overshot by 2 on one of these prompts);
    # the tokens it shares with plain generate() must still be equal.
    overshoot = [
        m
        for m in report["mismatches"]
        if m["method"] == "prompt_lookup_skinny" and m["first_difference"] == m["baseline_new_tokens"] < m["new_tokens"]
    ]
    assert not overshoot or not BUILTIN  # never on transformers 5, whose prompt lookup stops at max_new_tokens
    assert [m for m in report["mismatches"] if m not in overshoot] == []
    assert {r["method"] for r in report["summary"]} == set(names)
    assert drafter.fast_cpu_linears is True  # restored after dflash_stock_linears
    assert not any("forward" in m.__dict__ for m in target.modules())  # skinny_linears handed the kernels back

    batch_prompts = [torch.tensor(p) for p in prompts]
    rows = bench.run_batch_benchmark(
        target,
        drafter,
        batch_prompts,
        batch_sizes=(3,),
        max_new_tokens=8,
        warmup=0,
        progress=False,
        methods=["dflash_stock_linears", "baseline_skinny", "dflash_lookup"],
    )
    assert [r["method"] for r in rows] == ["baseline", "dflash_stock_linears", "baseline_skinny", "dflash_lookup"]
    assert all(r["rows_equal"] for r in rows) and rows[2]["tau"] == 1.0
    assert drafter.fast_cpu_linears is True and drafter.ngram_lookup is None and drafter.draft_length is None
    with pytest.raises(ValueError, match="builtin_dflash"):
        bench.run_batch_benchmark(
            target, drafter, batch_prompts, batch_sizes=(1,), methods=["builtin_dflash"], progress=False
        )


def test_linear_kernel_benchmark_and_report():
    target = make_target("llama", dtype=torch.float32)
    rows = bench.run_linear_benchmark(target, (1, 3), repeats=1, warmup=0)
    assert [r["rows"] for r in rows] == [1, 3]
    assert rows[0]["linear_vs_one_row"] == 1.0
    for r in rows:
        assert r["linear_ms"] > 0 and r["skinny_ms"] > 0
        assert r["skinny_over_linear"] == pytest.approx(r["skinny_ms"] / r["linear_ms"])
    markdown = bench.format_linear_markdown(rows)
    assert "| 3 |" in markdown and "skinny_linear" in markdown
    with pytest.raises(ValueError, match="no nn.Linear"):
        bench.run_linear_benchmark(torch.nn.ReLU())


def test_method_registry():
    """Every method name has one registry entry with its label; without a drafter, the drafter's methods are skipped
    with the reason, the others are built."""
    assert list(bench.REGISTRY) == list(bench.DEFAULT_METHODS + bench.OPTIONAL_METHODS)
    assert bench.METHOD_LABELS == {name: spec.label for name, spec in bench.REGISTRY.items()}
    target = make_target("qwen3", dtype=torch.float32)
    methods, skipped = bench.build_methods(target, None, bench.DEFAULT_METHODS + bench.OPTIONAL_METHODS)
    assert [m.name for m in methods] == [
        "baseline",
        "prompt_lookup",
        "early_exit",
        "baseline_skinny",
        "prompt_lookup_skinny",
    ]
    assert skipped["assistant"] == "no --assistant-model given"
    assert all(
        skipped[name] == "no drafter given"
        for name in (
            "dflash",
            "dflash_adaptive",
            "builtin_dflash",
            "dflash_defaults",
            "dflash_lookup",
            "dflash_stock_linears",
        )
    )
    with pytest.raises(ValueError, match="unknown method"):
        bench.build_methods(target, None, ["fastest"])
