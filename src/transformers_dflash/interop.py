"""Interop: write a DFlash drafter in the layouts that the Hub, SGLang and vLLM read, and read any of them back.

    from transformers_dflash.interop import convert_drafter, export_drafter
    export_drafter(drafter, "out/released", "released", target_name_or_path="Qwen/Qwen3-8B")
    drafter = convert_drafter("out/released")            # any layout, detected from config.json

    dflash export --layout {hub,released,speculators} --out DIR DRAFTER
    dflash convert SRC --out DIR [--layout hub]

The three layouts (every one stores the weights as ONE `model.safetensors` with the same tensor names,
`layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `layers.{i}.self_attn.{q,k}_norm.weight`,
`layers.{i}.mlp.{gate,up,down}_proj.weight`, `layers.{i}.{input,post_attention}_layernorm.weight`, `fc.weight`,
`hidden_norm.weight`, `norm.weight`; only config.json and the files next to it differ):

1. `hub`: what `DFlashDraftModel.save_pretrained` writes (config.json with `model_type: "dflash"` and `auto_map`, the
   self-contained core files, `code_files`) plus a model card README.md; ready for `drafter.push_to_hub`, `hf upload` /
   `huggingface-cli upload`, and `AutoModel.from_pretrained(..., trust_remote_code=True)`.
2. `released`: the layout of the released DFlash checkpoints (keys in `shared/docs/dflash-spec.md`): `model_type:
   "qwen3"`, `architectures: ["DFlashDraftModel"]`, `auto_map: {"AutoModel": "dflash.DFlashDraftModel"}`,
   `dflash_config: {mask_token_id, target_layer_ids, block_size}` and `block_size` at the top level too (older
   readers look there, Qwen3.5-era readers in `dflash_config`). SGLang and vLLM load it by its architecture name
   with their own implementation. `auto_map` names `dflash.py`, which is our core's own entry point (`code_files`):
   the folder carries our core files, so `AutoModel.from_pretrained(..., trust_remote_code=True)` gives our
   `DFlashDraftModel` (whose `from_pretrained` re-reads the `qwen3`-typed config.json as a `DFlashConfig`) and our API
   (`generate(assistant_model=drafter)`), not the original repository's `spec_generate`.
3. `speculators`: the vLLM speculators format (`speculators_model_type: "dflash"`), which `vllm serve` reads directly.
   Schema, from vllm-project/speculators (read, not copied):
   - `src/speculators/config.py`: `SpeculatorModelConfig` fields `speculators_model_type`, `speculators_version`,
     `speculators_config`; `SpeculatorsConfig` = {algorithm, proposal_methods, default_proposal_method, verifier};
     `VerifierConfig` = {name_or_path, architectures};
   - `src/speculators/proposals/greedy.py`: proposal {proposal_type: "greedy", speculative_tokens (default 5),
     verifier_accept_k (1), accept_tolerance (0.0)};
   - `src/speculators/models/dflash/config.py`: `DFlashSpeculatorConfig` = {transformer_layer_config (a Qwen3Config
     dict), draft_vocab_size (default 32000), block_size (default 8), target_hidden_size (None),
     aux_hidden_state_layer_ids (None), mask_token_id (None), sliding_window_non_causal (False), projector_type
     ("dflash"; "domino" adds modules), shift_label, sample_from_anchor};
   - `src/speculators/convert/dflash/converter.py` (their z-lab -> speculators converter): same tensor names as the
     released layout; `speculative_tokens = block_size - 1`; `aux_hidden_state_layer_ids = target_layer_ids + 1`
     (the released ids index `hidden_states[id + 1]`, speculators/vLLM ids name the layer whose INPUT is captured);
   - `src/speculators/models/dflash/core.py`: embed_tokens / lm_head / verifier_lm_head / verifier_norm / t2d / d2t
     are verifier-owned (refilled from the verifier on load, not needed in the checkpoint for a full vocabulary);
   - vLLM `vllm/transformers_utils/configs/speculators/{base,algos}.py` (`update_dflash`): requires
     `speculators_config.proposal_methods[0].speculative_tokens`, `verifier.name_or_path`, `transformer_layer_config`,
     `mask_token_id`, `aux_hidden_state_layer_ids`; maps `dflash_config.target_layer_ids = aux - 1`; sliding layers
     are bidirectional inside a block when `sliding_window_non_causal` is true (docs:
     https://docs.vllm.ai/en/v0.22.1/api/vllm/transformers_utils/configs/speculators/algos/).
   We write `architectures: ["DFlashDraftModel"]` (what speculators' `save_pretrained` writes), `speculators_version:
   "0.5.0"` (the first release with DFlash, per https://docs.vllm.ai/projects/speculators/en/stable/user_guide/
   tutorials/train_dflash_online/), `sliding_window_non_causal: true` (our sliding layers see the whole block), the
   full decoder config (not a diff) in `transformer_layer_config` with `model_type: "qwen3"`, and one extra key,
   `num_target_layers` (speculators' config allows extra keys; it lets a round trip keep it).

Reading is strict: a layout is detected from config.json; only safetensors are read (pickled `.bin`/`.pt` files are
refused with a clear message, never unpickled); no code from the folder is ever run (the installed classes are used);
missing, unexpected or mis-shaped tensors raise. What DFlash-here cannot represent is refused rather than approximated:
a speculators reduced draft vocabulary (own lm_head + d2t), a hidden size different from the target's, causal
sliding-window blocks, Domino heads. Our own reduced draft vocabulary (`draft_vocab_ids`, rows of the target's LM head)
exports to the hub layout only; the released and speculators exports refuse it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .code_files import ENTRY_POINT, HUB_AUTO_MAP, RELEASED_AUTO_MAP, code_files, write_code_files
from .configuration_dflash import DFlashConfig, decoder_shape_kwargs, rope_parameters_from_config
from .model_card import CardMetadata, metadata_from_training_dir, write_model_card
from .target_model import text_config
from .modeling_dflash import DFlashDraftModel

logger = logging.getLogger(__name__)

LAYOUTS = ("hub", "released", "speculators")
PACKAGE_DIR = Path(__file__).resolve().parent
CODE_FILES = tuple(path.name for path in code_files())  # the carried core, as `code_files` defines it
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
CARD_NAME = "README.md"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
SPECULATORS_VERSION = "0.5.0"
# Tensors a speculators checkpoint may carry that belong to the verifier (src/speculators/models/dflash/core.py,
# `_keys_to_ignore_on_load_missing`): our drafter borrows the target's embeddings and LM head instead.
SPECULATORS_VERIFIER_TENSORS = (
    "embed_tokens.weight",
    "lm_head.weight",
    "verifier_lm_head.weight",
    "verifier_norm.weight",
    "t2d",
    "d2t",
)

# The documented schemas: key -> allowed JSON types. `check_layout` checks an exported folder against them.
_NUM = (int, float)
_OPT_INT = (int, type(None))
RELEASED_CONFIG_SCHEMA = {  # shared/docs/dflash-spec.md, "Released checkpoint config.json"
    "architectures": list,
    "auto_map": dict,
    "model_type": str,
    "block_size": int,
    "dflash_config": dict,
    "num_target_layers": int,
    "hidden_size": int,
    "intermediate_size": int,
    "num_hidden_layers": int,
    "num_attention_heads": int,
    "num_key_value_heads": int,
    "head_dim": int,
    "hidden_act": str,
    "rms_norm_eps": _NUM,
    "rope_theta": _NUM,
    "rope_scaling": (dict, type(None)),
    "max_position_embeddings": int,
    "attention_bias": bool,
    "attention_dropout": _NUM,
    "layer_types": list,
    "sliding_window": _OPT_INT,
    "use_sliding_window": bool,
    "max_window_layers": int,
    "tie_word_embeddings": bool,
    "vocab_size": int,
    "bos_token_id": _OPT_INT,
    "eos_token_id": (int, list, type(None)),
    "dtype": str,
    "initializer_range": _NUM,
}
SPECULATORS_CONFIG_SCHEMA = {  # src/speculators/config.py + src/speculators/models/dflash/config.py
    "speculators_model_type": str,
    "speculators_version": str,
    "speculators_config": dict,
    "transformer_layer_config": dict,
    "draft_vocab_size": int,
    "block_size": int,
    "target_hidden_size": int,
    "aux_hidden_state_layer_ids": list,
    "mask_token_id": int,
}
SPECULATORS_ALGORITHM_SCHEMA = {  # SpeculatorsConfig
    "algorithm": str,
    "proposal_methods": list,
    "default_proposal_method": str,
    "verifier": dict,
}
HUB_CONFIG_SCHEMA = {
    "model_type": str,
    "auto_map": dict,
    "architectures": list,
    "block_size": int,
    "mask_token_id": int,
    "target_layer_ids": list,
    "dflash_config": dict,
}



# --------------------------------------------------------------------------------------------------------------------
# Helpers


@dataclass
class TargetInfo:
    """What export needs to know about the target: its name (card `base_model`, speculators verifier) and, when its
    config can be read locally, its architectures, depth and hidden size."""

    name: str | None = None
    architectures: list[str] = field(default_factory=list)
    num_layers: int | None = None
    hidden_size: int | None = None


def target_info(target) -> TargetInfo:
    """`target`: None, a Hub id / path (its config is read from disk or the local cache only, never downloaded), a
    model or a config."""
    if target is None:
        return TargetInfo()
    config, name = None, None
    if isinstance(target, (str, os.PathLike)):
        name = str(target)
        try:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(name, local_files_only=True)
        except Exception:  # noqa: BLE001 - not available offline: the name alone still serves
            config = None
    else:
        config = getattr(target, "config", target)
        name = getattr(config, "_name_or_path", None) or getattr(target, "name_or_path", None) or None
    if config is None:
        return TargetInfo(name=name)
    text = text_config(config)
    return TargetInfo(
        name=name,
        architectures=list(getattr(config, "architectures", None) or []),
        num_layers=getattr(text, "num_hidden_layers", None),
        hidden_size=getattr(text, "hidden_size", None),
    )


def _check_fits_target(config: DFlashConfig, target: TargetInfo) -> None:
    if target.hidden_size is not None and target.hidden_size != config.hidden_size:
        raise ValueError(
            f"The drafter's hidden size is {config.hidden_size} but the target {target.name!r} has "
            f"{target.hidden_size}: this drafter was built for another target."
        )
    if target.num_layers is not None:
        if config.num_target_layers is not None and config.num_target_layers != target.num_layers:
            raise ValueError(
                f"The drafter was built for a {config.num_target_layers}-layer target, but {target.name!r} has "
                f"{target.num_layers} layers."
            )
        if max(config.target_layer_ids) >= target.num_layers:
            raise ValueError(
                f"target_layer_ids {config.target_layer_ids} do not exist in {target.name!r} "
                f"({target.num_layers} layers)."
            )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _drafter_dtype(drafter: torch.nn.Module) -> torch.dtype:
    return next(drafter.parameters()).dtype


def _state_dict_for_safetensors(drafter: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().to("cpu").contiguous() for name, tensor in drafter.state_dict().items()}


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})  # transformers expects format "pt"


def expected_tensor_names(config: DFlashConfig) -> set[str]:
    """The tensor names of a DFlash drafter with `config`, in every layout."""
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        names |= {p + f"self_attn.{m}_proj.weight" for m in "qkvo"}
        names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
        names |= {p + f"mlp.{m}_proj.weight" for m in ("gate", "up", "down")}
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        if getattr(config, "attention_bias", False):
            names |= {p + f"self_attn.{m}_proj.bias" for m in "qkvo"}
    if getattr(config, "draft_vocab_size", None) is not None:
        names.add("draft_vocab_ids")  # reduced draft vocabulary (hub layout only)
    return names


def _json_number(value):
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _rope_fields(config: DFlashConfig) -> tuple[float, dict | None]:
    """RoPE as the 4.x spelling (`rope_theta`, `rope_scaling`) that the released checkpoints, SGLang, vLLM and both
    transformers majors read (transformers 5 folds it into `rope_parameters` itself)."""
    params = rope_parameters_from_config(config)
    theta = params.pop("rope_theta")
    scaling = None if params.get("rope_type", "default") == "default" and set(params) <= {"rope_type"} else params
    return _json_number(theta), scaling


def _decoder_fields(config: DFlashConfig) -> dict:
    """The Qwen3-style decoder settings shared by the released config.json and speculators' transformer_layer_config,
    in the released checkpoints' key order."""
    rope_theta, rope_scaling = _rope_fields(config)
    sliding = "sliding_attention" in config.layer_types
    return {
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": bool(config.attention_bias),
        "attention_dropout": config.attention_dropout,
        "layer_types": list(config.layer_types),
        "sliding_window": config.sliding_window,
        "use_sliding_window": bool(sliding or config.use_sliding_window),
        "max_window_layers": config.max_window_layers,
        "tie_word_embeddings": False,
        "vocab_size": config.vocab_size,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
    }


def _require_mask_token(config: DFlashConfig) -> int:
    if config.mask_token_id is None:
        raise ValueError("The drafter has no mask_token_id; set drafter.config.mask_token_id before exporting.")
    return int(config.mask_token_id)


def released_config(config: DFlashConfig, dtype: torch.dtype, num_target_layers: int | None = None) -> dict:
    """config.json of the released DFlash checkpoint layout (Qwen3-8B drafter keys, shared/docs/dflash-spec.md)."""
    num_target_layers = config.num_target_layers or num_target_layers
    if num_target_layers is None:
        raise ValueError(
            "The released layout records num_target_layers, which this drafter's config does not know: pass the "
            "target (target_name_or_path / --target) or set drafter.config.num_target_layers."
        )
    decoder = _decoder_fields(config)
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "block_size": config.block_size,
        "dflash_config": {
            "mask_token_id": _require_mask_token(config),
            "target_layer_ids": list(config.target_layer_ids),
            "block_size": config.block_size,
        },
        "num_target_layers": int(num_target_layers),
        **decoder,
        "dtype": _dtype_name(dtype),
        "initializer_range": config.initializer_range,
    }


def speculators_config(
    config: DFlashConfig, dtype: torch.dtype, target: TargetInfo | None = None, num_target_layers: int | None = None
) -> dict:
    """config.json of the vLLM speculators layout (schema and sources: module docstring)."""
    target = target or TargetInfo()
    num_target_layers = config.num_target_layers or num_target_layers or target.num_layers
    if num_target_layers is not None and num_target_layers - 1 in config.target_layer_ids:
        raise ValueError(
            f"target_layer_ids {config.target_layer_ids} include the target's last layer ({num_target_layers - 1}), "
            "whose output the speculators layout cannot name: vLLM captures the input of layer id + 1, and there is "
            "no such layer. Export this drafter in the hub or released layout instead."
        )
    transformer_layer_config = {
        "model_type": "qwen3",
        **_decoder_fields(config),
        "initializer_range": config.initializer_range,
    }
    out = {
        "architectures": ["DFlashDraftModel"],
        "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": config.block_size - 1,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target.name, "architectures": list(target.architectures)},
        },
        "transformer_layer_config": transformer_layer_config,
        "draft_vocab_size": config.vocab_size,
        "block_size": config.block_size,
        "target_hidden_size": config.hidden_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
        "mask_token_id": _require_mask_token(config),
        "sliding_window_non_causal": True,
        "dtype": _dtype_name(dtype),
    }
    if num_target_layers is not None:
        out["num_target_layers"] = int(num_target_layers)
    return out


def _managed_file(name: str) -> bool:
    return (
        name in (CONFIG_NAME, CARD_NAME, WEIGHTS_INDEX_NAME, "generation_config.json")
        or name in CODE_FILES
        or name.endswith(".safetensors")
        or name.endswith(PICKLE_SUFFIXES)
    )


def _prepare_out_dir(out_dir: str | os.PathLike, overwrite: bool) -> Path:
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out} exists and is not a folder.")
    out.mkdir(parents=True, exist_ok=True)
    present = sorted(p.name for p in out.iterdir())
    if present and not overwrite:
        raise FileExistsError(f"{out} is not empty ({', '.join(present[:5])}...); pass overwrite=True (--overwrite).")
    for name in present:  # overwrite: drop the checkpoint files of a previous export, keep anything else
        if (out / name).is_file() and _managed_file(name):
            (out / name).unlink()
    return out


# --------------------------------------------------------------------------------------------------------------------
# Export


def export_drafter(
    drafter: DFlashDraftModel,
    out_dir: str | os.PathLike,
    layout: str,
    target_name_or_path=None,
    card_metadata: CardMetadata | dict | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `drafter` into `out_dir` in `layout` ("hub", "released" or "speculators"); returns the folder.

    target_name_or_path: the target's Hub id or path (or the model / its config): the card's `base_model`, the
        speculators `verifier`, and, when its config is on disk, a check that the drafter fits it.
    card_metadata: training metadata for the model card (`transformers_dflash.model_card.CardMetadata` or a dict).
    overwrite: allow a non-empty `out_dir` (its previous checkpoint files are removed, other files kept).

    The folder is checked against the layout's schema before returning (`check_layout`).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}.")
    config = drafter.config
    if layout != "hub" and getattr(config, "draft_vocab_size", None) is not None:
        raise ValueError(
            f"This drafter drafts from a reduced vocabulary ({config.draft_vocab_size} tokens, `draft_vocab_ids`), "
            f"which the {layout} layout cannot express (its readers score the target's whole LM head). Export it "
            "with --layout hub, or train a drafter without --draft-vocab-size for that layout."
        )
    target = target_info(target_name_or_path)
    _check_fits_target(config, target)
    metadata = CardMetadata.coerce(card_metadata)
    if target.name and not metadata.target:
        metadata = metadata.merged({"target": target.name})
    out = _prepare_out_dir(out_dir, overwrite)
    dtype = _drafter_dtype(drafter)

    if layout == "hub":
        drafter.save_pretrained(out)
        write_code_files(out)  # also for a drafter class whose save_pretrained does not write them
    elif layout == "released":
        content = released_config(config, dtype, num_target_layers=target.num_layers)
        (out / CONFIG_NAME).write_text(json.dumps(content, indent=2) + "\n")
        _save_safetensors(_state_dict_for_safetensors(drafter), out / WEIGHTS_NAME)
        write_code_files(out, RELEASED_AUTO_MAP)
    else:
        if target.name is None:
            warnings.warn(
                "No target given: the speculators config names no verifier (speculators_config.verifier.name_or_path "
                "is null), so `vllm serve DIR` cannot find the target; name it on the vLLM command line instead.",
                stacklevel=2,
            )
        content = speculators_config(config, dtype, target)
        (out / CONFIG_NAME).write_text(json.dumps(content, indent=2) + "\n")
        _save_safetensors(_state_dict_for_safetensors(drafter), out / WEIGHTS_NAME)

    files = sorted(p.name for p in out.iterdir() if p.is_file()) + [CARD_NAME]
    write_model_card(out, config, metadata, layout, files=_card_file_order(files))
    problems = check_layout(out, layout)
    if problems:
        raise RuntimeError(f"The exported {layout} folder {out} does not match its schema: {problems}")
    return out


def _card_file_order(files: list[str]) -> list[str]:
    order = [CONFIG_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME, *CODE_FILES, CARD_NAME]
    known = [name for name in order if name in files]
    return known + sorted(set(files) - set(known))


def push_drafter_to_hub(
    drafter: DFlashDraftModel,
    repo_id: str,
    layout: str = "hub",
    target_name_or_path=None,
    card_metadata: CardMetadata | dict | None = None,
    private: bool | None = None,
    token: str | bool | None = None,
    commit_message: str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
):
    """Upload `drafter` to the Hub repo `repo_id` in `layout`, WITH its model card (returns the commit info).

    `drafter.push_to_hub(repo_id)` works as for any transformers model (config with `auto_map`, the three code files,
    model.safetensors), but on a new repo transformers writes its own generic README; it keeps an existing one. This
    uploads the full export, our card included; later `drafter.push_to_hub(repo_id)` calls then keep that card.
    """
    from huggingface_hub import HfApi

    api = HfApi()
    repo_id = api.create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
    metadata = CardMetadata(model_id=repo_id).merged(card_metadata)
    with tempfile.TemporaryDirectory() as tmp:
        export_drafter(drafter, tmp, layout, target_name_or_path=target_name_or_path, card_metadata=metadata)
        return api.upload_folder(
            repo_id=repo_id,
            folder_path=tmp,
            commit_message=commit_message or f"Upload DFlash drafter ({layout} layout)",
            token=token,
            revision=revision,
            create_pr=create_pr,
        )


# --------------------------------------------------------------------------------------------------------------------
# Schema checks


def _check_types(content: dict, schema: dict, where: str) -> list[str]:
    problems = []
    for key, types in schema.items():
        if key not in content:
            problems.append(f"{where}: missing key {key!r}")
        elif not isinstance(content[key], types) or (types is int and isinstance(content[key], bool)):
            problems.append(f"{where}: {key!r} is {type(content[key]).__name__}, expected {types}")
    return problems


def _weight_names(folder: Path) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """{tensor name: shape} of the folder's safetensors (read from headers only) and the problems found."""
    from safetensors import safe_open

    files, problems = _weight_files(folder)
    shapes = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes, problems


def check_layout(folder: str | os.PathLike, layout: str | None = None) -> list[str]:
    """Problems of `folder` as a checkpoint in `layout` (detected when None): required config keys and their types,
    the files the layout needs, exactly the DFlash tensor names with the right shapes, no pickled weights, and the code
    files importing only torch and transformers. An empty list means the folder matches its documented schema."""
    folder = Path(folder)
    layout = layout or detect_layout(folder)
    content = _read_config(folder)
    problems: list[str] = []
    if layout == "released":
        problems += _check_types(content, RELEASED_CONFIG_SCHEMA, CONFIG_NAME)
        if content.get("architectures") != ["DFlashDraftModel"]:
            problems.append("architectures must be ['DFlashDraftModel']")
        if content.get("auto_map") != RELEASED_AUTO_MAP:
            problems.append(f"auto_map must be {RELEASED_AUTO_MAP}")
        if content.get("model_type") != "qwen3":
            problems.append("model_type must be 'qwen3'")
        problems += _check_types(
            content.get("dflash_config") or {}, {"mask_token_id": int, "target_layer_ids": list}, "dflash_config"
        )
        needed = [CONFIG_NAME, *CODE_FILES]
    elif layout == "speculators":
        problems += _check_types(content, SPECULATORS_CONFIG_SCHEMA, CONFIG_NAME)
        algorithm = content.get("speculators_config") or {}
        problems += _check_types(algorithm, SPECULATORS_ALGORITHM_SCHEMA, "speculators_config")
        if content.get("speculators_model_type") != "dflash" or algorithm.get("algorithm") != "dflash":
            problems.append("speculators_model_type and speculators_config.algorithm must be 'dflash'")
        methods = algorithm.get("proposal_methods") or [{}]
        problems += _check_types(methods[0], {"proposal_type": str, "speculative_tokens": int}, "proposal_methods[0]")
        if algorithm.get("default_proposal_method") not in [m.get("proposal_type") for m in methods]:
            problems.append("default_proposal_method must be the proposal_type of one of proposal_methods")
        problems += _check_types(
            algorithm.get("verifier") or {}, {"name_or_path": (str, type(None)), "architectures": list}, "verifier"
        )
        needed = [CONFIG_NAME]
    else:
        problems += _check_types(content, HUB_CONFIG_SCHEMA, CONFIG_NAME)
        auto_map = content.get("auto_map") or {}
        if auto_map != HUB_AUTO_MAP:
            problems.append(f"auto_map must be {HUB_AUTO_MAP}: {auto_map}")
        needed = [CONFIG_NAME, *CODE_FILES]
    problems += [f"missing file {name}" for name in needed if not (folder / name).is_file()]
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            problems += [f"{name}: {p}" for p in code_import_problems(folder / name)]
    if problems:
        return problems
    try:
        config = _dflash_config_from_folder(folder, layout, content)
    except ValueError as error:
        return [f"{CONFIG_NAME} does not read as a DFlash drafter config: {error}"]
    shapes, weight_problems = _weight_names(folder)
    problems += weight_problems
    expected = expected_tensor_names(config)
    if set(shapes) != expected:
        problems.append(
            f"tensor names differ from the DFlash layout: missing {sorted(expected - set(shapes))[:5]}, "
            f"unexpected {sorted(set(shapes) - expected)[:5]}"
        )
    fc_in = len(config.target_layer_ids) * config.hidden_size
    if shapes.get("fc.weight") not in (None, (config.hidden_size, fc_in)):
        problems.append(f"fc.weight has shape {shapes['fc.weight']}, expected {(config.hidden_size, fc_in)}")
    return problems


# Code next to a checkpoint may import torch, transformers, the standard library and its sibling files: nothing a
# machine with transformers installed could lack.
ALLOWED_CODE_IMPORTS = {"torch", "transformers"} | set(sys.stdlib_module_names)


def code_import_problems(path: str | os.PathLike) -> list[str]:
    """Imports of a code file other than torch, transformers, the standard library and its sibling files."""
    import ast

    path = Path(path)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots = [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: must be a sibling file
                module = (node.module or "").split(".")[0]
                if module and not (path.parent / f"{module}.py").is_file():
                    problems.append(f"line {node.lineno}: relative import of missing file {module}.py")
                continue
            roots = [(node.module or "").split(".")[0]]
        else:
            continue
        problems += [f"line {node.lineno}: imports {root}" for root in roots if root not in ALLOWED_CODE_IMPORTS]
    return problems


# --------------------------------------------------------------------------------------------------------------------
# Reading any layout


def _read_config(folder: Path) -> dict:
    path = Path(folder) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"No {CONFIG_NAME} in {folder}: not a drafter checkpoint folder.")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def detect_layout(folder: str | os.PathLike) -> str:
    """"hub", "released" or "speculators", from the folder's config.json."""
    content = _read_config(Path(folder))
    if "speculators_model_type" in content:
        return "speculators"
    if content.get("model_type") == "dflash":
        return "hub"
    if "dflash_config" in content or "DFlashDraftModel" in (content.get("architectures") or []):
        return "released"
    raise ValueError(
        f"{Path(folder) / CONFIG_NAME} does not describe a DFlash drafter: expected model_type 'dflash' (our layout), "
        "a dflash_config (released DFlash layout) or speculators_model_type 'dflash' (vLLM speculators layout)."
    )


def _weight_files(folder: Path) -> tuple[list[Path], list[str]]:
    """The safetensors files holding the weights, refusing pickled checkpoints (returns the files and warnings)."""
    names = sorted(os.listdir(folder))
    pickled = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
    index = folder / WEIGHTS_INDEX_NAME
    if (folder / WEIGHTS_NAME).is_file():
        files = [folder / WEIGHTS_NAME]
    elif index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        files = [folder / n for n in names if n.endswith(".safetensors")]
    if not files:
        if pickled:
            raise ValueError(
                f"{folder} holds only pickled weights ({', '.join(pickled)}). DFlash checkpoints are read from "
                "safetensors only: loading a pickle can run arbitrary code. If you trust the file, convert it "
                "separately, e.g. safetensors.torch.save_file(torch.load(path, weights_only=True), "
                "'model.safetensors'), and try again."
            )
        raise ValueError(f"No model.safetensors in {folder}.")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"{folder} lacks the safetensors shards {missing} named by its index.")
    notes = [f"ignored pickled files {pickled} (only safetensors are read)"] if pickled else []
    return files, notes


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files, notes = _weight_files(folder)
    for note in notes:
        warnings.warn(f"{folder}: {note}", stacklevel=3)
    tensors = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors


def _rope_from_raw(raw: dict, fallback_config) -> dict:
    """RoPE settings of a raw config dict in either transformers spelling; unset parts from `fallback_config`."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        params = dict(params)
    elif raw.get("rope_theta") is not None or raw.get("rope_scaling"):
        params = dict(raw.get("rope_scaling") or {})
        if raw.get("rope_theta") is not None:
            params["rope_theta"] = raw["rope_theta"]
    else:
        return rope_parameters_from_config(fallback_config)
    params.setdefault("rope_theta", rope_parameters_from_config(fallback_config)["rope_theta"])
    params["rope_type"] = params.pop("type", None) or params.get("rope_type") or "default"
    return params


def _decoder_kwargs_from_transformers_config(raw: dict) -> dict:
    """DFlashConfig keyword arguments from a transformers decoder config dict (speculators' transformer_layer_config).

    Unset keys take the defaults of the config class its `model_type` names (speculators writes a diff against
    Qwen3Config and reads it back through that class, so this is how it interprets the same dict)."""
    from transformers import AutoConfig

    model_type = raw.get("model_type", "qwen3")
    skipped = {"model_type", "rope_theta", "rope_scaling", "rope_parameters", "architectures", "auto_map",
               "transformers_version", "dtype", "torch_dtype", "_name_or_path"}
    try:
        decoder = AutoConfig.for_model(model_type, **{k: v for k, v in raw.items() if k not in skipped})
    except (KeyError, ValueError) as error:
        raise ValueError(f"transformer_layer_config (model_type {model_type!r}) cannot be read: {error}") from error
    layers = decoder.num_hidden_layers
    return dict(
        decoder_shape_kwargs(decoder),
        num_hidden_layers=layers,
        initializer_range=getattr(decoder, "initializer_range", 0.02),
        rope_parameters=_rope_from_raw(raw, decoder),
        attention_bias=bool(getattr(decoder, "attention_bias", False)),
        attention_dropout=getattr(decoder, "attention_dropout", 0.0),
        layer_types=list(getattr(decoder, "layer_types", None) or ["full_attention"] * layers),
        sliding_window=getattr(decoder, "sliding_window", None),
        use_sliding_window=bool(getattr(decoder, "use_sliding_window", False)),
        max_window_layers=getattr(decoder, "max_window_layers", None),
    )


def speculators_to_dflash_config(content: dict) -> DFlashConfig:
    """Our DFlashConfig from a speculators config.json dict; refuses what our drafter cannot represent exactly."""
    if content.get("speculators_model_type") != "dflash":
        raise ValueError(
            f"speculators_model_type is {content.get('speculators_model_type')!r}: only DFlash speculators convert "
            "into a DFlash drafter."
        )
    refusals = {
        "projector_type": (lambda v: v not in (None, "dflash"), "adds Domino correction modules"),
        "sample_from_anchor": (lambda v: bool(v), "predicts the anchor slot too (DSpark-style)"),
        "shift_label": (lambda v: bool(v), "shifts its predictions by one position"),
    }
    for key, (bad, why) in refusals.items():
        if bad(content.get(key)):
            raise ValueError(
                f"This speculators drafter has {key}={content[key]!r}, which {why}; not a plain DFlash drafter."
            )
    raw = content.get("transformer_layer_config")
    if not isinstance(raw, dict):
        raise ValueError("The speculators config has no transformer_layer_config dict.")
    kwargs = _decoder_kwargs_from_transformers_config(raw)
    aux = content.get("aux_hidden_state_layer_ids")
    if not aux:
        raise ValueError("The speculators config names no aux_hidden_state_layer_ids (the target layers to read).")
    if min(aux) < 1:
        raise ValueError(f"aux_hidden_state_layer_ids {aux} include 0 (the embeddings), which DFlash cannot read.")
    if content.get("mask_token_id") is None:
        raise ValueError("The speculators config has no mask_token_id.")
    draft_vocab = content.get("draft_vocab_size")
    if draft_vocab is not None and draft_vocab != kwargs["vocab_size"]:
        raise ValueError(
            f"This speculators drafter uses a reduced draft vocabulary ({draft_vocab} of {kwargs['vocab_size']} "
            "tokens, with its own lm_head and d2t/t2d maps); a DFlash drafter here uses the target's full LM head."
        )
    target_hidden = content.get("target_hidden_size")
    if target_hidden is not None and target_hidden != kwargs["hidden_size"]:
        raise ValueError(
            f"target_hidden_size {target_hidden} differs from the drafter's hidden size {kwargs['hidden_size']}; "
            "DFlash drafters here share the target's hidden size."
        )
    if "sliding_attention" in kwargs["layer_types"] and not content.get("sliding_window_non_causal", False):
        raise ValueError(
            "This speculators drafter has sliding-window layers with causal masking inside a block "
            "(sliding_window_non_causal false); DFlash drafters here see the whole block in every layer, so its drafts "
            "would change."
        )
    return DFlashConfig(
        **kwargs,
        block_size=content.get("block_size", 8),  # speculators' default
        mask_token_id=content["mask_token_id"],
        target_layer_ids=[int(i) - 1 for i in aux],
        num_target_layers=content.get("num_target_layers"),
        tie_word_embeddings=False,
    )


def _dflash_config_from_folder(folder: Path, layout: str, content: dict | None = None) -> DFlashConfig:
    content = content if content is not None else _read_config(folder)
    if layout == "speculators":
        return speculators_to_dflash_config(content)
    kwargs = {k: v for k, v in content.items() if k not in ("model_type", "transformers_version")}
    return DFlashConfig(**kwargs)


def _resolve_dtype(dtype, tensors: dict[str, torch.Tensor]) -> torch.dtype:
    if dtype in (None, "auto"):
        floating = [t.dtype for t in tensors.values() if t.is_floating_point()]
        return floating[0] if floating else torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


class _QuietConfigWarnings:
    """Silence transformers' 'model of type qwen3 to instantiate a model of type dflash' note: expected here."""

    def __enter__(self):
        from transformers.utils import logging as hf_logging

        self.logger = hf_logging.get_logger("transformers.configuration_utils")
        self.level = self.logger.level
        self.logger.setLevel(logging.ERROR)

    def __exit__(self, *exc):
        self.logger.setLevel(self.level)


def _local_folder(path: str | os.PathLike) -> Path:
    """A local folder for `path`; a Hub repo id is fetched WITHOUT its code or pickled files (config, safetensors and
    the card only)."""
    if os.path.isdir(path):
        return Path(path)
    if isinstance(path, str) and path.count("/") == 1 and not os.path.exists(path):
        from huggingface_hub import snapshot_download

        try:
            return Path(
                snapshot_download(path, allow_patterns=[CONFIG_NAME, "*.safetensors", WEIGHTS_INDEX_NAME, CARD_NAME])
            )
        except Exception as error:  # noqa: BLE001 - offline, unknown repo, no access: one clear message
            raise FileNotFoundError(
                f"{path} is not a local folder, and fetching it from the Hub failed: {type(error).__name__}: {error}"
            ) from error
    raise FileNotFoundError(f"{path} is not a folder (nor a Hub repo id).")


def convert_drafter(path: str | os.PathLike, dtype="auto", layout: str | None = None) -> DFlashDraftModel:
    """A `DFlashDraftModel` from a drafter checkpoint in any layout (detected from config.json unless `layout` is set).

    Only safetensors are read (pickled weights are refused with a ValueError), no code from the folder runs, and every
    tensor must match (ValueError otherwise). `dtype`: "auto" (the checkpoint's), a torch dtype or its name.
    """
    folder = _local_folder(path)
    layout = layout or detect_layout(folder)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}.")
    _, notes = _weight_files(folder)  # refuses pickled-only folders before anything is loaded
    for note in notes:
        warnings.warn(f"{folder}: {note}", stacklevel=2)
    if layout in ("hub", "released"):
        with _QuietConfigWarnings():
            return DFlashDraftModel.from_pretrained(folder, dtype=dtype).eval()

    config = speculators_to_dflash_config(_read_config(folder))
    tensors = _read_safetensors(folder)
    dropped = sorted(name for name in tensors if name in SPECULATORS_VERIFIER_TENSORS)
    if dropped:
        logger.info("Dropping the verifier-owned tensors %s: the drafter borrows the target's.", dropped)
    tensors = {name: t for name, t in tensors.items() if name not in SPECULATORS_VERIFIER_TENSORS}
    drafter = DFlashDraftModel._from_config(config, dtype=_resolve_dtype(dtype, tensors))
    expected = drafter.state_dict()
    problems = {
        "missing": sorted(set(expected) - set(tensors)),
        "unexpected": sorted(set(tensors) - set(expected)),
        "mis-shaped": sorted(n for n in set(expected) & set(tensors) if expected[n].shape != tensors[n].shape),
    }
    problems = {kind: names for kind, names in problems.items() if names}
    if problems:
        details = "; ".join(f"{kind} tensors: {names[:8]}" for kind, names in problems.items())
        raise ValueError(
            f"The speculators checkpoint in {folder} does not match the DFlash drafter layout ({details})."
        )
    drafter.load_state_dict(tensors, strict=True)
    return drafter.eval()


def card_info(path: str | os.PathLike) -> dict:
    """Model-card metadata recorded in a drafter folder: the speculators verifier (as `target`), the Hub YAML of its
    README.md (`base_model`, `datasets`, `license`, `language`, extra `tags`), and `dflash train`'s log.jsonl."""
    folder = Path(path)
    found: dict = {}
    try:
        content = _read_config(folder)
    except FileNotFoundError:
        content = {}
    verifier = (content.get("speculators_config") or {}).get("verifier") or {}
    if verifier.get("name_or_path"):
        found["target"] = verifier["name_or_path"]
    if (folder / CARD_NAME).is_file():
        try:
            from huggingface_hub import ModelCard

            data = ModelCard.load(folder / CARD_NAME).data.to_dict()
        except Exception:  # noqa: BLE001 - a card without valid YAML simply contributes nothing
            data = {}
        if isinstance(data.get("base_model"), str):
            found.setdefault("target", data["base_model"])
        for key in ("datasets", "license", "language"):
            if data.get(key):
                found[key] = data[key]
        extra = [t for t in data.get("tags") or [] if t not in ("dflash", "speculative-decoding")]
        if extra:
            found["tags"] = extra
    found.update(metadata_from_training_dir(folder))
    return found


# --------------------------------------------------------------------------------------------------------------------
# CLI: `dflash export` and `dflash convert` (registered in cli.py)


def _add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="the folder to write (must be empty unless --overwrite)")
    parser.add_argument(
        "--target",
        default=None,
        help="the target model's Hub id or path: the card's base_model and the speculators verifier (default: the one "
        "recorded in the source folder, if any)",
    )
    parser.add_argument("--repo-id", default=None, help="the Hub repo the folder will be uploaded to (usage snippets)")
    parser.add_argument(
        "--card",
        default=None,
        help="a JSON file of model-card metadata (keys: transformers_dflash.model_card.CardMetadata)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights' dtype in the output",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace the checkpoint files of a non-empty --out")


def add_export_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("drafter", help="a drafter folder in any layout (e.g. the output of `dflash train`)")
    parser.add_argument("--layout", required=True, choices=LAYOUTS, help="hub: transformers + Hub; released: the "
                        "released DFlash layout (SGLang, vLLM); speculators: the vLLM speculators layout")
    _add_common_arguments(parser)
    parser.epilog = (
        "examples:\n"
        "  dflash export --layout hub --out my-drafter-hub runs/drafter\n"
        "  dflash export --layout released --target Qwen/Qwen3-8B --out my-drafter-sglang runs/drafter\n"
        "  dflash export --layout speculators --target Qwen/Qwen3-8B --out my-drafter-vllm runs/drafter\n"
        "  hf upload YOUR-NAME/my-drafter my-drafter-hub   # upload (older hubs: huggingface-cli upload)"
    )
    return parser


def add_convert_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("source", help="a drafter folder (or Hub repo id) in any layout; detected from config.json")
    parser.add_argument("--layout", default="hub", choices=LAYOUTS, help="the layout to write")
    _add_common_arguments(parser)
    return parser


def _write(source: str, layout: str, args: argparse.Namespace, verb: str) -> int:
    folder = _local_folder(source)
    source_layout = detect_layout(folder)
    drafter = convert_drafter(folder, dtype=args.dtype)
    metadata = CardMetadata.coerce(card_info(folder))
    if args.card:
        with open(args.card, encoding="utf-8") as f:
            metadata = metadata.merged(json.load(f))
    metadata = metadata.merged({"target": args.target, "model_id": args.repo_id})
    out = export_drafter(drafter, args.out, layout, target_name_or_path=metadata.target, card_metadata=metadata,
                         overwrite=args.overwrite)
    files = ", ".join(sorted(p.name for p in out.iterdir() if p.is_file()))
    print(f"{verb} {source} ({source_layout} layout) -> {out} ({layout} layout): {files}")
    return 0


def _run(source: str, layout: str, args: argparse.Namespace, verb: str, command: str) -> int:
    try:
        return _write(source, layout, args, verb)
    except (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError) as error:
        raise SystemExit(f"dflash {command}: {error}") from error


def run_export(args: argparse.Namespace) -> int:
    return _run(args.drafter, args.layout, args, "Exported", "export")


def run_convert(args: argparse.Namespace) -> int:
    return _run(args.source, args.layout, args, "Converted", "convert")


__all__ = [
    "LAYOUTS",
    "CardMetadata",
    "TargetInfo",
    "card_info",
    "check_layout",
    "code_import_problems",
    "convert_drafter",
    "detect_layout",
    "expected_tensor_names",
    "export_drafter",
    "push_drafter_to_hub",
    "released_config",
    "speculators_config",
    "speculators_to_dflash_config",
    "target_info",
]
