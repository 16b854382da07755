"""Model cards for DFlash drafters: `model_cards/template.md` filled from the drafter's config and training metadata.

    from transformers_dflash.model_card import render_model_card
    text = render_model_card(drafter.config, {"target": "Qwen/Qwen3-8B", "steps": 20000, "acceptance_length": 6.1})

The card starts with the Hub's YAML metadata (`base_model`, `library_name: transformers`, `pipeline_tag:
text-generation`, `tags: [dflash, speculative-decoding, ...]`, plus `datasets` / `license` / `language` when given),
then describes the drafter (shapes, target layers, block size), how it was trained (target, data, steps), the acceptance
length measured for it, and how to use it in the layout it was exported in (see `transformers_dflash.interop`).

Training metadata comes as a dict or a `CardMetadata` (see its fields); `metadata_from_training_dir` reads what
`dflash train` logged (`log.jsonl`: optimizer steps and the last validation acceptance length).

The template is `model_cards/template.md` at the repository root; `{{ name }}` marks a field. Where the package is
installed without the repository (a wheel), the identical copy in `BUILTIN_TEMPLATE` is used.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from .code_files import code_files

BASE_TAGS = ("dflash", "speculative-decoding")
TEMPLATE_PATH = Path(__file__).resolve().parents[2] / "model_cards" / "template.md"
LAYOUTS = ("hub", "released", "speculators")

# Identical to model_cards/template.md (a test keeps them in sync).
BUILTIN_TEMPLATE = """---
{{ metadata }}
---

# {{ title }}

{{ summary }}

DFlash ([arXiv 2602.06036](https://arxiv.org/abs/2602.06036)) is lossless speculative decoding with a block-diffusion
drafter: at each step the drafter fills a whole block of masked tokens in ONE forward pass, conditioned on hidden
states of the target model itself, and the target checks the block in one forward pass. The output is exactly the
target's own: identical tokens under greedy decoding, the target's distribution under sampling. The drafter has no
embedding table and no LM head of its own; it borrows both from the target, so it only works with the target below.

## Model details

{{ details }}

## Training

{{ training }}

## Measured acceptance

{{ acceptance }}

## How to use

{{ usage }}

## Files

{{ files }}

## Safety

The weights are stored as safetensors only; pickled weights (`.bin`, `.pt`) are never written nor read. Python files
next to the weights, if any, import only `torch` and `transformers`, and importing them does nothing beyond defining
the classes and registering the hook that lets `generate(assistant_model=...)` decode with DFlash. Read them before
loading with `trust_remote_code=True`, as with any remote code.

## Reference

Chen, Liang and Liu, "DFlash: Block Diffusion for Flash Speculative Decoding", arXiv:2602.06036.
"""


@dataclass
class CardMetadata:
    """What a model card says beyond the drafter's config. Every field is optional."""

    target: str | None = None  # Hub id (or path) of the target model; the card's `base_model`
    model_id: str | None = None  # the repo id the drafter is published as, used in the usage snippets
    title: str | None = None
    data: str | None = None  # free text: what the drafter was trained on
    datasets: list[str] = field(default_factory=list)  # Hub dataset ids (YAML `datasets`)
    num_samples: int | None = None  # training examples
    steps: int | None = None  # optimizer steps
    epochs: float | None = None
    learning_rate: float | None = None
    block_size: int | None = None  # block size used in training, when it differs from the config's
    kl_weight: float | None = None  # share of KL to the target's top tokens in the training loss (0: cross-entropy)
    acceptance_length: float | None = None  # measured mean acceptance length tau (bonus token included)
    acceptance_setting: str | None = None  # how tau was measured: prompts, temperature, hardware, ...
    speedup: float | None = None  # measured speedup over plain generate()
    hardware: str | None = None
    license: str | None = None
    language: list[str] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)  # extra Hub tags (dflash and speculative-decoding are always there)
    notes: str | None = None
    # free text after the card's file list: e.g. how a copy that holds fewer files than the export was made
    files_note: str | None = None

    _ALIASES = {
        "base_model": "target",
        "tau": "acceptance_length",
        "max_steps": "steps",
        "lr": "learning_rate",
        "dataset": "datasets",
        "val_acceptance_length": "acceptance_length",
    }

    @classmethod
    def coerce(cls, value: CardMetadata | dict | None) -> CardMetadata:
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            return cls.from_dict(value)
        raise TypeError(f"card metadata must be a dict or a CardMetadata, got {type(value).__name__}")

    @classmethod
    def from_dict(cls, data: dict) -> CardMetadata:
        """Strict: an unknown key raises (a typo would otherwise vanish from the card silently)."""
        names = {f.name for f in fields(cls)}
        values, unknown = {}, []
        for key, value in data.items():
            key = cls._ALIASES.get(key, key)
            if key not in names:
                unknown.append(key)
            elif value is not None:
                values[key] = [value] if key in ("datasets", "language", "tags") and isinstance(value, str) else value
        if unknown:
            raise ValueError(f"Unknown model-card metadata {sorted(unknown)}; known keys: {sorted(names)}.")
        return cls(**values)

    def merged(self, other: CardMetadata | dict | None) -> CardMetadata:
        """`self` with the fields that `other` sets (non-empty) taking precedence."""
        other = CardMetadata.coerce(other)
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        for f in fields(other):
            value = getattr(other, f.name)
            if value not in (None, [], ""):
                values[f.name] = value
        return CardMetadata(**values)


def metadata_from_training_dir(path: str | Path) -> dict:
    """Card metadata from a `dflash train` output folder: `steps` and the last validation `acceptance_length` found in
    its `log.jsonl` (empty when there is no log)."""
    log = Path(path) / "log.jsonl"
    if not log.is_file():
        return {}
    steps, tau, kl_weight = None, None, None
    for line in log.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == "start" and isinstance(record.get("config"), dict):
            value = record["config"].get("kl_weight")  # as trained with (older logs: 0.0, cross-entropy alone)
            kl_weight = float(value) if isinstance(value, (int, float)) else kl_weight
        if isinstance(record.get("step"), int):
            steps = max(steps or 0, record["step"])
        value = record.get("val_acceptance_length")
        if isinstance(value, (int, float)) and not math.isnan(value):
            tau = float(value)
    found = {}
    if steps is not None:
        found["steps"] = steps
    if kl_weight is not None:
        found["kl_weight"] = kl_weight
    if tau is not None:
        found["acceptance_length"] = tau
        found["acceptance_setting"] = "greedy decoding of the held-out validation prompts at the end of training"
    return found


def load_template(path: str | Path | None = None) -> str:
    if path is not None:
        return Path(path).read_text(encoding="utf-8")
    if TEMPLATE_PATH.is_file():
        return TEMPLATE_PATH.read_text(encoding="utf-8")
    return BUILTIN_TEMPLATE


def fill_template(template: str, values: dict[str, str]) -> str:
    """Replace every `{{ name }}` by `values[name]`; a field without a value raises."""
    missing = sorted({m for m in re.findall(r"\{\{\s*(\w+)\s*\}\}", template) if m not in values})
    if missing:
        raise KeyError(f"The model-card template needs values for {missing}.")
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: values[m.group(1)], template)


def card_yaml(metadata: CardMetadata) -> str:
    """The Hub metadata block (without the `---` fences)."""
    from huggingface_hub import ModelCardData

    tags = list(BASE_TAGS) + [t for t in metadata.tags if t not in BASE_TAGS]
    data = ModelCardData(
        base_model=metadata.target or None,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=tags,
        datasets=list(metadata.datasets) or None,
        license=metadata.license or None,
        language=list(metadata.language) or None,
    )
    return data.to_yaml()


def _table(rows: list[tuple[str, object]]) -> str:
    lines = ["| | |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in rows if value not in (None, "", [])]
    return "\n".join(lines)


def _num(value, fmt=","):
    return format(value, fmt) if isinstance(value, (int, float)) else value


def _parameter_count(config) -> int:
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 2 * config.head_dim + 3 * h * inter + 2 * h
    if getattr(config, "attention_bias", False):
        per_layer += q + 2 * kv + h
    return layers * per_layer + len(config.target_layer_ids) * h * h + 2 * h


def _details(config, metadata: CardMetadata, layout: str) -> str:
    kinds = sorted(set(config.layer_types))
    attention = ", ".join(f"{config.layer_types.count(k)} x {k}" for k in kinds)
    if config.sliding_window and "sliding_attention" in kinds:
        attention += f" (window {config.sliding_window})"
    target_layers = f"{list(config.target_layer_ids)}"
    if getattr(config, "num_target_layers", None):
        target_layers += f" of {config.num_target_layers} (hidden state `layer_id + 1`, 0 = embeddings)"
    dtype = getattr(config, "dtype", None)
    return _table(
        [
            ("Target model", f"`{metadata.target}`" if metadata.target else "not recorded"),
            ("Target layers read", target_layers),
            ("Drafter layers", config.num_hidden_layers),
            ("Attention", attention),
            ("Hidden size / MLP width", f"{config.hidden_size} / {config.intermediate_size}"),
            (
                "Heads (query / key-value) x head dim",
                f"{config.num_attention_heads} / {config.num_key_value_heads} x {config.head_dim}",
            ),
            ("Block size (anchor + masked slots)", config.block_size),
            ("Mask token id", config.mask_token_id),
            ("Vocabulary (the target's)", _num(config.vocab_size)),
            (
                "Draft vocabulary",
                f"{_num(config.draft_vocab_size)} tokens (`draft_vocab_ids`: the drafter proposes only "
                "these; verification uses the whole vocabulary)"
                if getattr(config, "draft_vocab_size", None)
                else "the whole vocabulary",
            ),
            ("Parameters", _num(_parameter_count(config))),
            ("Weights dtype", str(dtype).replace("torch.", "") if dtype is not None else None),
            (
                "Checkpoint layout",
                {
                    "hub": "transformers (config with `auto_map` + code + safetensors)",
                    "released": "released DFlash checkpoint (`dflash.py`, `model_type: qwen3`)",
                    "speculators": "vLLM speculators (`speculators_model_type: dflash`)",
                }[layout],
            ),
        ]
    )


def _training(metadata: CardMetadata) -> str:
    rows = [
        ("Target (frozen)", f"`{metadata.target}`" if metadata.target else None),
        ("Data", metadata.data),
        ("Datasets", ", ".join(f"`{d}`" for d in metadata.datasets) or None),
        ("Training examples", _num(metadata.num_samples)),
        ("Optimizer steps", _num(metadata.steps)),
        ("Epochs", metadata.epochs),
        ("Peak learning rate", metadata.learning_rate),
        ("Block size in training", metadata.block_size),
        ("Hardware", metadata.hardware),
    ]
    if all(value in (None, "", []) for _, value in rows[1:]):
        text = "Not recorded."
    else:
        text = _table(rows)
    loss = "a position-decayed cross-entropy"
    if metadata.kl_weight:
        share = f"{metadata.kl_weight:g}"
        loss = (
            f"a position-decayed loss mixing cross-entropy with KL divergence to the target's most likely tokens "
            f"(share {share})"
        )
    text += (
        "\n\nRecipe (DFlash): the target answers the training prompts itself and the drafter learns to predict "
        f"its answers; random anchors per sequence, blocks of [anchor, MASK x (block_size - 1)], {loss}; the "
        "target, its embeddings and its LM head stay frozen."
    )
    if metadata.notes:
        text += f"\n\n{metadata.notes}"
    return text


def _acceptance(metadata: CardMetadata) -> str:
    if metadata.acceptance_length is None and metadata.speedup is None:
        return (
            "Not measured yet. The mean acceptance length tau (tokens committed per target forward, bonus token "
            "included; 1.0 means no draft is ever accepted) tells how much a drafter can speed decoding up."
        )
    parts = []
    if metadata.acceptance_length is not None:
        parts.append(
            f"Mean acceptance length **tau = {metadata.acceptance_length:.2f}** tokens per target forward "
            "(bonus token included)."
        )
    if metadata.speedup is not None:
        parts.append(f"Speedup over plain `generate()`: **{metadata.speedup:.2f}x**.")
    if metadata.acceptance_setting:
        parts.append(f"Measured on: {metadata.acceptance_setting}.")
    return " ".join(parts)


def _usage(config, metadata: CardMetadata, layout: str) -> str:
    target = metadata.target or "TARGET-MODEL-ID"
    repo = metadata.model_id or "THIS-REPO-ID"
    python = "\n".join(
        [
            "```python",
            "from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer",
            "",
            f'target = AutoModelForCausalLM.from_pretrained("{target}", dtype="auto")',
            f'tokenizer = AutoTokenizer.from_pretrained("{target}")',
            # The target's dtype, not the drafter's stored one: a half-precision drafter next to a float32 target
            # drafts slower on CPUs, and a float32 one next to a bfloat16 target on GPUs (README).
            f'drafter = AutoModel.from_pretrained("{repo}", trust_remote_code=True, dtype=target.dtype)',
            "",
            'messages = [{"role": "user", "content": "Explain in a few sentences why the sky is blue."}]',
            'inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", '
            "return_dict=True)",
            "out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=256)",
            'print(tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))',
            "print(drafter.last_acceptance_lengths)  # tokens committed per target forward",
            "```",
        ]
    )
    remote = (
        "`trust_remote_code=True` runs the Python files of this repository (they import only torch and "
        "transformers). With `pip install transformers-dflash`, `DFlashDraftModel.from_pretrained` loads the "
        "drafter without remote code. `out` is exactly what `target.generate(**inputs, max_new_tokens=256)` "
        "returns; greedy and sampling, streamers and the other `generate()` options keep working."
    )
    num_spec = config.block_size - 1
    vllm = (
        "```bash\n"
        f"vllm serve {target} \\\n"
        f'  --speculative-config \'{{"method": "dflash", "model": "{repo}", '
        f'"num_speculative_tokens": {num_spec}}}\'\n'
        "```"
    )
    if layout == "hub" and getattr(config, "draft_vocab_size", None):
        return (
            f"With transformers:\n\n{python}\n\n{remote}\n\n"
            "SGLang and vLLM cannot run this drafter as it is: their DFlash readers score the target's whole LM "
            "head, while this drafter proposes from its reduced draft vocabulary (`draft_vocab_ids`)."
        )
    if layout == "hub":
        return (
            f"With transformers:\n\n{python}\n\n{remote}\n\n"
            "For SGLang or vLLM, export the released DFlash layout or the speculators layout first:\n\n"
            f"```bash\ndflash export --layout released --out drafter-released {repo}\n"
            f"dflash export --layout speculators --target {target} --out drafter-speculators {repo}\n```"
        )
    if layout == "released":
        sglang = (
            "```bash\n"
            "python -m sglang.launch_server \\\n"
            f"  --model-path {target} \\\n"
            "  --speculative-algorithm DFLASH \\\n"
            f"  --speculative-draft-model-path {repo} \\\n"
            f"  --speculative-num-draft-tokens {config.block_size} \\\n"
            "  --trust-remote-code\n"
            "```"
        )
        return (
            f"This repository uses the layout of the released DFlash checkpoints (`model_type: qwen3` + "
            f"`dflash_config`), which SGLang and vLLM load as `DFlashDraftModel`.\n\nSGLang:\n\n{sglang}\n\n"
            f"vLLM:\n\n{vllm}\n\nWith transformers (`dflash.py` serves the transformers-dflash implementation):"
            f"\n\n{python}\n\n{remote}"
        )
    return (
        f"This repository uses the vLLM speculators layout (`speculators_model_type: dflash`).\n\nvLLM, with the "
        f"verifier named in `config.json` (`{target}`) as the target:\n\n```bash\nvllm serve {repo}\n```\n\n"
        f"or naming the target explicitly:\n\n{vllm}\n\n"
        "With transformers (`pip install transformers-dflash`), from a local copy of this repository:\n\n"
        "```python\nfrom transformers_dflash.interop import convert_drafter\n\n"
        "drafter = convert_drafter(local_dir)  # a DFlashDraftModel; then target.generate(..., "
        "assistant_model=drafter)\n```"
    )


_FILE_NOTES = {
    "config.json": "the drafter's configuration",
    "model.safetensors": "the weights",
    "README.md": "this card",
}


def _files(files: list[str] | None, layout: str) -> str:
    """The card's file list; the core's code files (`code_files`) are one line, led by the entry point."""
    core = [path.name for path in code_files()]
    if files is None:
        files = ["config.json", "model.safetensors", *(core if layout in ("hub", "released") else []), "README.md"]
    lines = []
    for name in files:
        if name in core:
            if name == core[0]:
                lines.append(
                    f"- `{core[0]}` and the {len(core) - 1} files it imports: the DFlash drafter and decoding code "
                    "(torch and transformers only), which `auto_map` names"
                )
            continue
        lines.append(f"- `{name}`" + (f": {_FILE_NOTES[name]}" if name in _FILE_NOTES else ""))
    return "\n".join(lines)


def render_model_card(
    config,
    metadata: CardMetadata | dict | None = None,
    layout: str = "hub",
    files: list[str] | None = None,
    template: str | None = None,
) -> str:
    """The model card (Markdown with Hub YAML metadata) of a drafter with `config` (a `DFlashConfig`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    metadata = CardMetadata.coerce(metadata)
    title = metadata.title or (
        f"DFlash drafter for {metadata.target.split('/')[-1]}" if metadata.target else "DFlash drafter"
    )
    summary = (
        f"A DFlash drafter for [`{metadata.target}`](https://huggingface.co/{metadata.target}): "
        if metadata.target and "/" in metadata.target and not Path(metadata.target).exists()
        else "A DFlash drafter: "
    )
    summary += (
        f"{config.num_hidden_layers} decoder layer(s) that propose {config.block_size - 1} tokens per step, "
        f"reading the target's layers {list(config.target_layer_ids)}."
    )
    values = {
        "metadata": card_yaml(metadata),
        "title": title,
        "summary": summary,
        "details": _details(config, metadata, layout),
        "training": _training(metadata),
        "acceptance": _acceptance(metadata),
        "usage": _usage(config, metadata, layout),
        "files": _files(files, layout) + (f"\n\n{metadata.files_note}" if metadata.files_note else ""),
    }
    return fill_template(template if template is not None else load_template(), values)


def write_model_card(out_dir: str | Path, config, metadata=None, layout: str = "hub", files=None) -> Path:
    path = Path(out_dir) / "README.md"
    path.write_text(render_model_card(config, metadata, layout, files), encoding="utf-8")
    return path
