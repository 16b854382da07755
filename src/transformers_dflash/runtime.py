"""Helpers that the command line and the benchmarks share: device synchronisation, the default thread count, chat
encoding, the `--chat-template-kwargs` option of `dflash demo` / `bench` / `regenerate`, and the drafter to run (a
folder, else the shipped SmolLM2 drafter, else an untrained one).

torch and the core are imported inside the functions, so importing this module (as `dflash --help` does) is instant.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from .smollm2 import SHIPPED_DRAFTER


def synchronize(device) -> None:
    """Wait for the device's queued work (CUDA only), so that wall-clock timings cover the work they time."""
    import torch

    if getattr(device, "type", str(device)).startswith("cuda"):
        torch.cuda.synchronize(device)


def default_threads() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


CHAT_TEMPLATE_KWARGS_EXAMPLE = """--chat-template-kwargs '{"enable_thinking": false}'"""
# apply_chat_template arguments that the commands set themselves (or whose output they rely on): as template
# variables they would clash with them ("got multiple values for keyword argument") or change what is returned.
RESERVED_CHAT_TEMPLATE_KWARGS = (
    "messages",
    "conversation",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "chat_template",
    "return_tensors",
    "return_dict",
)


def parse_chat_template_kwargs(text: str) -> dict:
    """`--chat-template-kwargs`: a JSON object of extra chat-template variables (e.g. `{"enable_thinking": false}`)
    as a dict. An argparse `type=`: bad JSON, JSON that is not an object, or a name the commands set themselves
    raises `argparse.ArgumentTypeError`, which argparse reports as a usage error (exit code 2)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not valid JSON ({error.msg} at character {error.pos + 1}). Give a JSON object with "
            f"double-quoted names and lowercase true/false/null, quoted for the shell, e.g. "
            f"{CHAT_TEMPLATE_KWARGS_EXAMPLE}"
        ) from None
    if not isinstance(value, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")
        raise argparse.ArgumentTypeError(
            f"{text!r} is {kind}, not a JSON object of chat-template variables; e.g. {CHAT_TEMPLATE_KWARGS_EXAMPLE}"
        )
    reserved = [name for name in value if name in RESERVED_CHAT_TEMPLATE_KWARGS]
    if reserved:
        raise argparse.ArgumentTypeError(
            f"{text!r} sets {', '.join(map(repr, reserved))}, which the command passes to apply_chat_template itself; "
            f"give template variables only, e.g. {CHAT_TEMPLATE_KWARGS_EXAMPLE}"
        )
    return value


def add_chat_template_kwargs_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """The `--chat-template-kwargs JSON` option (parsed into a dict, None when not given); `what` says which chat
    formatting it reaches, for the help."""
    parser.add_argument(
        "--chat-template-kwargs",
        type=parse_chat_template_kwargs,
        default=None,
        metavar="JSON",
        help=f"extra variables for the chat template, as a JSON object, passed to every apply_chat_template call "
        f"({what}), e.g. '{{\"enable_thinking\": false}}' (Qwen3.5/3.6 templates think by default, and DFlash users "
        "report acceptance collapsing in thinking mode); default: none, the template's own defaults",
    )


def chat_messages(prompt: str, system_prompt: str | None = None) -> list[dict]:
    """`prompt` as one user turn, after a system turn when `system_prompt` is given."""
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return system + [{"role": "user", "content": prompt}]


def chat_text(
    tokenizer,
    messages: list[dict],
    chat_template: str | None = None,
    chat_template_kwargs: dict | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """`messages` through the chat template (`chat_template` overrides the tokenizer's), as text."""
    return tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        chat_template=chat_template,
        **(chat_template_kwargs or {}),
    )


def encode_chat(
    tokenizer,
    prompt: str,
    device=None,
    chat_template_kwargs: dict | None = None,
    system_prompt: str | None = None,
    chat_template: str | None = None,
):
    """`prompt` as one user turn of the chat template (plain text when there is none): [1, seq] ids.

    `chat_template` overrides the tokenizer's template; `chat_template_kwargs` (e.g. `{"enable_thinking": False}`)
    go to it as template variables. Without a template, variables or a system prompt cannot be honoured (ValueError
    rather than silently leaving them out)."""
    if chat_template is not None or getattr(tokenizer, "chat_template", None):
        messages = chat_messages(prompt, system_prompt)
        text = chat_text(tokenizer, messages, chat_template, chat_template_kwargs)
        # The template already holds every special token it needs.
        input_ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    elif chat_template_kwargs or system_prompt:
        given = f"chat template variables {chat_template_kwargs}" if chat_template_kwargs else "a system prompt"
        raise ValueError(
            f"{given} were given, but the tokenizer has no chat template (its prompts are encoded as plain text); set "
            "tokenizer.chat_template or leave them out"
        )
    else:
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    return input_ids.to(device) if device is not None else input_ids


def chat_token_ids(
    tokenizer,
    prompt: str,
    system_prompt: str | None = None,
    chat_template: str | None = None,
    chat_template_kwargs: dict | None = None,
) -> list[int]:
    """`encode_chat`'s ids of one prompt as a list (what the data engines take)."""
    kwargs = dict(chat_template_kwargs=chat_template_kwargs, system_prompt=system_prompt, chat_template=chat_template)
    return encode_chat(tokenizer, prompt, **kwargs)[0].tolist()


def load_drafter(
    target,
    path: str | os.PathLike | None = None,
    block_size: int | None = None,
    num_layers: int = 1,
    attn: str | None = None,
):
    """`(drafter, description, trained)` for `target`, in its dtype and on its device: the drafter at `path`, else the
    shipped SmolLM2 drafter when its folder is there, else an untrained one (`num_layers`, block 16 unless
    `block_size`; seeded, so that two runs measure the same drafter). `block_size` overrides a trained drafter's
    block; `attn` sets the drafter's attention implementation."""
    import torch

    from .modeling_dflash import DFlashDraftModel

    param = next(target.parameters())
    folder = Path(path) if path is not None else SHIPPED_DRAFTER
    if path is not None or (folder / "config.json").is_file():
        drafter = DFlashDraftModel.from_pretrained(folder, dtype=param.dtype).to(param.device).eval()
        if block_size is not None:
            drafter.config.block_size = block_size
        description, trained = f"trained, from {folder}", True
    else:
        torch.manual_seed(0)
        drafter = DFlashDraftModel.from_target(target, num_layers=num_layers, block_size=block_size or 16).eval()
        description = f"UNTRAINED (random weights, {num_layers} layer(s)): no speedup expected"
        trained = False
    if attn:
        drafter.config._attn_implementation = attn
    description += f", block {drafter.config.block_size}"
    return drafter, description, trained
