"""`dflash bench`: the options, and the command that loads the models and runs `transformers_dflash.bench`.

Imports nothing heavy at module level, so that `dflash bench --help` is instant; torch, transformers and the benchmark
code load when the command runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..bench.methods import BATCH_METHODS, DEFAULT_METHODS, OPTIONAL_METHODS
from ..runtime import add_chat_template_kwargs_argument, default_threads
from ..smollm2 import SHIPPED_DRAFTER


def add_bench_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of `dflash bench`."""
    parser.add_argument(
        "--dataset",
        action="append",
        default=None,
        help="mtbench, humaneval or a JSONL file of prompts (see transformers_dflash.data.load_jsonl_prompts); "
        "repeat the option for several (default: mtbench)",
    )
    parser.add_argument("--num-prompts", type=int, default=5, help="prompts per dataset")
    parser.add_argument(
        "--prompt-selection",
        choices=["spread", "first"],
        default="spread",
        help="'spread': evenly spaced over the dataset (covers MT-Bench's categories); 'first': the first N",
    )
    add_chat_template_kwargs_argument(parser, "every text prompt of every dataset; recorded in the report")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most per prompt")
    parser.add_argument("--temperatures", default="0,1", help="comma-separated; 0 = greedy, >0 = sampling")
    parser.add_argument(
        "--methods",
        default=",".join(DEFAULT_METHODS),
        help=f"comma-separated among {', '.join(DEFAULT_METHODS + OPTIONAL_METHODS)}, or 'all'",
    )
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per method and prompt")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs per method and temperature first")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (the same for every method)")
    parser.add_argument("--target", default=None, help="a local causal LM folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument(
        "--drafter",
        default=None,
        help=f"a DFlash drafter folder (default: {SHIPPED_DRAFTER} if present, else an UNTRAINED drafter)",
    )
    parser.add_argument(
        "--compare-drafter",
        action="append",
        default=None,
        metavar="DIR",
        help="another drafter folder for the same target, run at its defaults beside --drafter's "
        "(method dflash_defaults:<folder name>, interleaved with the others and compared with dflash_defaults, "
        "which is added to --methods); repeat the option for several",
    )
    parser.add_argument(
        "--fixed-step-costs",
        nargs="?",
        const="measure",
        default=None,
        metavar="FILE",
        help="compare drafters by their drafts alone: every 'auto' draft length (the CPU default) chooses its widths "
        "from one table of step costs, not from its own timing, and the report adds modelled speedups (the table's "
        "cost of the steps taken). Without FILE the costs are measured first: --drafter decodes the first prompt "
        "verifying 1, 2, ... block-size tokens every step; "
        "FILE: a report JSON of an earlier run with this option (or verify_seconds and draft_seconds), to reuse its "
        "costs (a drafter of a shape it lacks has its draft cost measured)",
    )
    parser.add_argument(
        "--block-size", type=int, default=None, help="block size (default: the drafter's; 16 untrained)"
    )
    parser.add_argument("--drafter-layers", type=int, default=1, help="layers of an untrained drafter")
    parser.add_argument(
        "--draft-length",
        default="auto",
        help="dflash_adaptive: drafter.draft_length, 'auto' or a confidence threshold in [0, 1]",
    )
    parser.add_argument("--prompt-lookup-tokens", type=int, default=10, help="prompt lookup: tokens per draft")
    parser.add_argument("--early-exit-layer", type=int, default=None, help="early_exit: draft layers (default: L/4)")
    parser.add_argument(
        "--assistant-model",
        default=None,
        help="assistant: a smaller causal LM folder with the same vocabulary (default: none, the "
        "assistant method is skipped)",
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16", "float64"],
        default=None,
        help="weights' dtype (default: float32 on CPU, bfloat16 on CUDA)",
    )
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    parser.add_argument("--attn-implementation", default="sdpa", help="eager, sdpa or flash_attention_2")
    parser.add_argument(
        "--threads",
        type=int,
        default=default_threads(),
        help="torch CPU threads (default: the cores this process may use)",
    )
    parser.add_argument("--output-dir", default="bench-results", help="where bench.json/.md/.png go")
    parser.add_argument("--name", default="bench", help="file name stem of the outputs")
    parser.add_argument(
        "--cache-dir", default=None, help="SmolLM2 converted-copy cache (default: as for `dflash demo`)"
    )
    parser.add_argument("--no-draft-check", action="store_true", help="skip the ours-vs-built-in draft comparison")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also profile one greedy run of each DFlash path: time per step in draft / verify / cache / Python",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny random target + drafter and random prompts: checks the whole pipeline in seconds (numbers mean "
        "nothing)",
    )
    parser.add_argument(
        "--linear-kernels",
        default=None,
        metavar="ROWS",
        help="comma-separated row counts, e.g. 1,2,4,8,16,32,64,128: instead of decoding, time one pass over the "
        "target's nn.Linear weights with F.linear and with the transposed product (which the CPU kernel takes where "
        "it measures faster) at these row "
        "counts (writes <name>-linear.json/.md; default: off)",
    )
    parser.add_argument(
        "--batch-sizes",
        default=None,
        help="comma-separated, e.g. 1,4,8,16: instead of the per-prompt comparison, measure batched throughput (greedy) "
        "of plain generate() vs DFlash at these batch sizes (writes <name>-batch.json/.md; default: off)",
    )
    return parser


def _quick_models(dtype, device, block_size: int | None):
    """A tiny random Llama target (its weights scaled up so that its choices look like a real model's: peaked,
    repetitive) and a 1-layer drafter; random token prompts."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ..modeling_dflash import DFlashDraftModel

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    with torch.no_grad():
        for p in target.parameters():
            if p.dim() > 1:
                p.mul_(5.0)
    target = target.to(device).eval()
    drafter = DFlashDraftModel.from_target(target, num_layers=1, block_size=block_size or 4).eval()
    g = torch.Generator().manual_seed(0)
    prompts = {"random": [torch.randint(3, 128, (1, 12 + 4 * i), generator=g) for i in range(3)]}
    return target, drafter, prompts


def _comma_list(text: str, convert=str.strip) -> list:
    """The non-empty items of a comma-separated option, converted (ValueError when one does not convert)."""
    return [convert(item) for item in text.split(",") if item.strip()]


def _requested_methods(args) -> list[str]:
    methods = list(DEFAULT_METHODS + OPTIONAL_METHODS) if args.methods == "all" else _comma_list(args.methods)
    unknown = [m for m in methods if m not in DEFAULT_METHODS + OPTIONAL_METHODS]
    if unknown:
        raise SystemExit(
            f"dflash bench: unknown method(s) {unknown}; choose from "
            f"{', '.join(DEFAULT_METHODS + OPTIONAL_METHODS)} or 'all'."
        )
    return methods


def _load_target(args, dtype, dtype_name: str, device: str):
    """`(target, tokenizer, name)`: `--target`, else SmolLM2 (None when SmolLM2 is not installed: the message is
    printed)."""
    import torch

    start = time.perf_counter()
    print(f"Loading the target ({dtype_name}, {device}, {torch.get_num_threads()} thread(s))...", file=sys.stderr)
    if args.target:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.target)
        target = (
            AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype, attn_implementation=args.attn_implementation)
            .to(device)
            .eval()
        )
        name = args.target
    else:
        from ..smollm2 import SmolLM2NotAvailableError, load_smollm2

        try:
            target, tokenizer = load_smollm2(args.cache_dir, dtype=dtype, device=device)
        except SmolLM2NotAvailableError as error:
            print(f"\n{error}", file=sys.stderr)
            return None
        name = "SmolLM2-135M-Instruct"
    if args.attn_implementation and getattr(target.config, "_attn_implementation", None) != args.attn_implementation:
        target.set_attn_implementation(args.attn_implementation)
    print(f"Loaded in {time.perf_counter() - start:.1f} s.", file=sys.stderr)
    return target, tokenizer, name


def _load_datasets(args) -> tuple[dict, dict]:
    """`({name: prompts}, {name: their indices in the dataset})` of `--dataset` (default: MT-Bench)."""
    from ..bench.prompts import load_dataset_prompts, select_prompts

    datasets, prompt_indices = {}, {}
    for spec in args.dataset or ["mtbench"]:
        name, prompts = load_dataset_prompts(spec)
        prompt_indices[name], datasets[name] = select_prompts(prompts, args.num_prompts, args.prompt_selection)
    return datasets, prompt_indices


def run_bench(args: argparse.Namespace) -> int:
    """`dflash bench`: load the models and prompts, then run the per-prompt, batched or linear-kernel benchmark."""
    import torch

    from ..bench.drafter import parse_draft_length
    from ..bench.single_stream import UNTRAINED_NOTE
    from ..runtime import load_drafter

    torch.set_num_threads(max(1, args.threads))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    default_dtype = "float64" if args.quick else ("bfloat16" if device.startswith("cuda") else "float32")
    dtype_name = args.dtype or default_dtype
    dtype = getattr(torch, dtype_name)
    temperatures = _comma_list(args.temperatures, float)
    if args.max_new_tokens < 1 or args.num_prompts < 1 or args.repeats < 1 or args.warmup < 0 or not temperatures:
        raise SystemExit(
            "dflash bench: need --max-new-tokens, --num-prompts, --repeats >= 1, --warmup >= 0 and a temperature."
        )
    try:
        adaptive_setting = parse_draft_length(args.draft_length)
    except ValueError as error:
        raise SystemExit(f"dflash bench: --draft-length: {error}") from None
    methods = _requested_methods(args)
    if args.compare_drafter and "dflash_defaults" not in methods:
        methods.append("dflash_defaults")  # what the other drafters are compared with

    tokenizer, assistant, prompt_indices = None, None, {}
    if args.quick and args.chat_template_kwargs:
        raise SystemExit(
            "dflash bench: --chat-template-kwargs has no effect with --quick, whose prompts are random token ids "
            "(no chat template is applied); leave it out, or benchmark a --target with a chat template."
        )
    if args.fixed_step_costs and (args.batch_sizes or args.linear_kernels):
        raise SystemExit(
            "dflash bench: --fixed-step-costs applies to the per-prompt benchmark; leave out --batch-sizes and "
            "--linear-kernels."
        )
    if args.compare_drafter and (args.quick or args.batch_sizes or args.linear_kernels):
        raise SystemExit(
            "dflash bench: --compare-drafter needs the per-prompt benchmark of a real target; leave out --quick, "
            "--batch-sizes and --linear-kernels."
        )
    for path in args.compare_drafter or []:
        if not (Path(path) / "config.json").is_file():
            raise SystemExit(
                f"dflash bench: --compare-drafter {path}: no drafter there (no config.json); give a folder that "
                "`dflash train` or `dflash export` wrote."
            )
    if args.quick:
        target, drafter, datasets = _quick_models(dtype, device, args.block_size)
        datasets = {k: v[: args.num_prompts] for k, v in datasets.items()}
        description, trained, target_name = "UNTRAINED tiny random drafter (quick mode)", False, "tiny random Llama"
    else:
        loaded = _load_target(args, dtype, dtype_name, device)
        if loaded is None:
            return 1
        target, tokenizer, target_name = loaded
        if args.chat_template_kwargs and not getattr(tokenizer, "chat_template", None):
            raise SystemExit(
                f"dflash bench: --chat-template-kwargs was given, but the tokenizer of {target_name} has no chat "
                "template (its prompts are encoded as plain text, so there is nothing to pass the variables to)."
            )
        drafter, description, trained = load_drafter(
            target, args.drafter, args.block_size, args.drafter_layers, args.attn_implementation
        )
        if args.assistant_model:
            from transformers import AutoModelForCausalLM

            assistant = AutoModelForCausalLM.from_pretrained(args.assistant_model, dtype=dtype).to(device).eval()
        datasets, prompt_indices = _load_datasets(args)
    if not trained:
        print(
            f"\nNOTE: {UNTRAINED_NOTE}\n      A trained SmolLM2 drafter is expected at {SHIPPED_DRAFTER}.\n",
            file=sys.stderr,
        )
    if args.linear_kernels:
        return _run_linear_command(args, target, target_name, dtype_name, device)
    if args.batch_sizes:
        return _run_batch_command(
            args, target, drafter, tokenizer, datasets, adaptive_setting, description, target_name, dtype_name, device
        )
    return _run_single_stream_command(
        args,
        target,
        drafter,
        tokenizer,
        datasets,
        methods,
        temperatures,
        assistant,
        adaptive_setting,
        description,
        trained,
        {
            "target": target_name,
            "dtype": dtype_name,
            "attn_implementation": args.attn_implementation,
            "prompt_selection": args.prompt_selection,
            "prompt_indices": prompt_indices,
        },
    )


def _run_single_stream_command(
    args,
    target,
    drafter,
    tokenizer,
    datasets,
    methods,
    temperatures,
    assistant,
    adaptive_setting,
    description,
    trained,
    settings,
) -> int:
    """`dflash bench`: every method on every prompt, one prompt per call; the report as JSON, Markdown and PNG."""
    from ..bench.report import format_markdown, write_report
    from ..bench.single_stream import run_benchmark

    compared_drafters = _load_compared_drafters(args, target)
    step_costs = _fixed_step_costs(args, target, tokenizer, datasets, [drafter] + [d for _, d, _ in compared_drafters])
    compared = _compared_methods(compared_drafters, target, step_costs)
    report = run_benchmark(
        target,
        drafter,
        datasets=datasets,
        tokenizer=tokenizer,
        methods=methods,
        extra_methods=compared,
        comparisons=[(method.name, "dflash_defaults") for method in compared],
        temperatures=temperatures,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        warmup=args.warmup,
        seed=args.seed,
        prompt_lookup_tokens=args.prompt_lookup_tokens,
        early_exit_layer=args.early_exit_layer,
        assistant_model=assistant,
        adaptive_draft_length=adaptive_setting,
        step_costs=step_costs,
        check_drafts=not args.no_draft_check,
        profile=args.profile,
        progress=not args.no_progress,
        drafter_description=description,
        drafter_trained=trained,
        settings=settings,
        chat_template_kwargs=args.chat_template_kwargs,
    )
    paths = write_report(report, args.output_dir, args.name)
    print(format_markdown(report))
    print("Wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return 0


def _load_compared_drafters(args, target) -> list:
    """`(folder, drafter, description)` of each `--compare-drafter`."""
    from ..runtime import load_drafter

    loaded = []
    for path in args.compare_drafter or []:
        drafter, description, _ = load_drafter(target, path, args.block_size, attn=args.attn_implementation)
        loaded.append((path, drafter, description))
    return loaded


def _fixed_step_costs(args, target, tokenizer, datasets, drafters):
    """`--fixed-step-costs`: the `StepCosts` read from its file, or measured with the drafters on the first prompt
    (None without the option)."""
    from ..bench.fixed_costs import StepCosts, drafter_shape, measure_step_costs
    from ..bench.single_stream import _generate_kwargs, _pad_token_id, encode_prompt

    if not args.fixed_step_costs:
        return None
    costs = None
    if args.fixed_step_costs != "measure":
        try:
            costs = StepCosts.load(args.fixed_step_costs)
        except ValueError as error:
            raise SystemExit(f"dflash bench: --fixed-step-costs: {error}") from None
        if all(drafter_shape(d) in costs.draft_seconds for d in drafters):
            return costs
    device = next(target.parameters()).device
    first = next(iter(datasets.values()))[0]
    ids = encode_prompt(tokenizer, first, device, args.chat_template_kwargs)
    # Enough steps per width for a median, without decoding the whole budget at every width.
    kwargs = _generate_kwargs(ids, min(args.max_new_tokens, 64), 0.0, _pad_token_id(tokenizer, target))
    block_size = max(d.config.block_size for d in drafters)
    what = f"widths 1..{block_size}" if costs is None else "the draft costs of drafter shapes the file lacks"
    print(f"Measuring the step costs ({what}, first prompt)...", file=sys.stderr)
    try:
        costs = measure_step_costs(target, drafters, ids, kwargs, block_size, costs=costs)
    except ValueError as error:
        raise SystemExit(f"dflash bench: --fixed-step-costs: {error}") from None
    verify = ", ".join(f"{1000 * s:.1f}" for s in costs.verify_seconds)
    print(
        f"Step costs (ms): verify 1..{len(costs.verify_seconds)} tokens {verify}; drafts "
        + ", ".join(f"{1000 * s:.1f}" for s in costs.draft_seconds.values()),
        file=sys.stderr,
    )
    return costs


def _compared_methods(compared_drafters, target, step_costs) -> list:
    """Each `--compare-drafter` folder's drafter at its defaults, as a method named after the folder."""
    from ..bench.methods import Method, build_methods

    methods = []
    for path, drafter, description in compared_drafters:
        built, skipped = build_methods(target, drafter, ["dflash_defaults"], step_costs=step_costs)
        if skipped:
            raise SystemExit(f"dflash bench: --compare-drafter {path}: {skipped['dflash_defaults']}.")
        name = f"dflash_defaults:{Path(path).name}"
        taken = {m.name for m in methods} | {"dflash_defaults"}
        if name in taken:
            name = f"{name}#{len(methods) + 1}"
        (method,) = built
        methods.append(Method(name, f"{method.label}, drafter {path}", method.generate, description))
    return methods


def _environment_header(env: dict, what: str, *lines: str) -> str:
    """The Markdown header of the `--linear-kernels` / `--batch-sizes` reports: command, models, machine, versions."""
    return "\n".join(
        [
            f"- command: `{env.get('command', '')}`",
            f"- {what}; {env.get('device')} ({env.get('gpu') or env.get('cpu')}), {env.get('torch_threads')} torch "
            "thread(s)",
            *lines,
            f"- torch {env.get('torch')}, transformers {env.get('transformers')}, commit "
            f"{str((env.get('git') or {}).get('commit'))[:10]}",
        ]
    )


def _write_mode_report(out: Path, stem: str, report: dict, markdown: str) -> None:
    """`<stem>.json` and `<stem>.md` for the `--linear-kernels` / `--batch-sizes` modes; the table on stdout."""
    from ..bench.report import json_safe

    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(json_safe(report), indent=1) + "\n", encoding="utf-8")
    (out / f"{stem}.md").write_text(markdown, encoding="utf-8")
    print(markdown)
    print(f"Wrote {out / (stem + '.json')}, {out / (stem + '.md')}", file=sys.stderr)


def _run_linear_command(args, target, target_name, dtype_name, device) -> int:
    """`dflash bench --linear-kernels ...`: the matrix-product cost of a forward per row count, per kernel."""
    from ..bench.kernels import format_linear_markdown, run_linear_benchmark
    from ..bench.report import environment

    try:
        row_counts = _comma_list(args.linear_kernels, int)
    except ValueError:
        row_counts = []
    if not row_counts or min(row_counts) < 1:
        raise SystemExit(
            f"dflash bench: --linear-kernels must be positive row counts like 1,2,4,8, got {args.linear_kernels!r}."
        )
    rows = run_linear_benchmark(target, row_counts, repeats=max(args.repeats, 5), warmup=max(args.warmup, 1))
    env = environment(device)
    markdown = format_linear_markdown(rows, _environment_header(env, f"model: {target_name}; dtype {dtype_name}"))
    report = {
        "settings": {"row_counts": row_counts, "target": target_name, "dtype": dtype_name},
        "environment": env,
        "rows": rows,
    }
    _write_mode_report(Path(args.output_dir), f"{args.name}-linear", report, markdown)
    return 0


def _run_batch_command(
    args, target, drafter, tokenizer, datasets, adaptive_setting, description, target_name, dtype_name, device
) -> int:
    """`dflash bench --batch-sizes ...`: batched throughput over the prompts of all datasets, in order."""
    from ..bench.batched import format_batch_markdown, run_batch_benchmark
    from ..bench.report import chat_template_kwargs_text, environment
    from ..bench.single_stream import encode_prompt

    try:
        batch_sizes = _comma_list(args.batch_sizes, int)
    except ValueError:
        batch_sizes = []
    if not batch_sizes or min(batch_sizes) < 1:
        raise SystemExit(
            f"dflash bench: --batch-sizes must be positive integers like 1,4,8,16, got {args.batch_sizes!r}."
        )
    requested = BATCH_METHODS if args.methods == "all" else _comma_list(args.methods)
    batch_methods = [m for m in requested if m in BATCH_METHODS and m != "baseline"]
    if not batch_methods:
        raise SystemExit(f"dflash bench --batch-sizes: --methods must name at least one of {BATCH_METHODS[1:]}.")
    template_kwargs = dict(args.chat_template_kwargs or {})
    prompts = [encode_prompt(tokenizer, p, device, template_kwargs)[0] for ps in datasets.values() for p in ps]
    pad_token_id = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    rows = run_batch_benchmark(
        target,
        drafter,
        prompts,
        batch_sizes=batch_sizes,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        warmup=args.warmup,
        pad_token_id=pad_token_id,
        adaptive_draft_length=adaptive_setting,
        progress=not args.no_progress,
        methods=batch_methods,
    )
    env = environment(device)
    header = _environment_header(
        env,
        f"target: {target_name}; drafter: {description}; dtype {dtype_name}",
        f"- prompts: {', '.join(f'{k} ({len(v)})' for k, v in datasets.items())}, cycled to fill each batch; "
        f"max new tokens {args.max_new_tokens}; repeats {args.repeats}; warm-up {args.warmup}",
        f"- chat template kwargs: {chat_template_kwargs_text(template_kwargs)}",
    )
    markdown = format_batch_markdown(rows, header)
    report = {
        "settings": {
            "batch_sizes": batch_sizes,
            "max_new_tokens": args.max_new_tokens,
            "target": target_name,
            "drafter": description,
            "dtype": dtype_name,
            "chat_template_kwargs": template_kwargs,
        },
        "environment": env,
        "rows": rows,
    }
    _write_mode_report(Path(args.output_dir), f"{args.name}-batch", report, markdown)
    return 0
