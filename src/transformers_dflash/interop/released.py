"""The released DFlash checkpoint layout (keys in `shared/docs/dflash-spec.md`), which SGLang and vLLM load by its
architecture name: `model_type: "qwen3"`, `architectures: ["DFlashDraftModel"]`, `auto_map: {"AutoModel":
"dflash.DFlashDraftModel"}`, `dflash_config: {mask_token_id, target_layer_ids, block_size}` and `block_size` at the
top level too (older readers look there, Qwen3.5-era readers in `dflash_config`). `auto_map` names `dflash.py`, our
core's own entry point: the folder carries our core files, so `AutoModel.from_pretrained(..., trust_remote_code=True)`
gives our `DFlashDraftModel` (whose `from_pretrained` re-reads the `qwen3`-typed config.json as a `DFlashConfig`) and
our API (`generate(assistant_model=drafter)`), not the original repository's `spec_generate`.

The DFlash authors' own released folders (z-lab) have the same config.json and tensor names but carry THEIR
`dflash.py`. With this package imported they load either way: `DFlashDraftModel.from_pretrained(path)` reads the
config and weights and runs none of the folder's code; `AutoModel.from_pretrained(path, trust_remote_code=True)` gives
their class, whose instance `generate(assistant_model=...)` adopts (`DFlashDraftModel.from_released_model`: our drafter
holding the same Parameter objects decodes). Loaded without code (no `trust_remote_code`, or a copy without
`dflash.py`), such a folder becomes a plain `Qwen3Model` with its `fc`/`hidden_norm` dropped and random embeddings;
`generate` refuses it and names `DFlashDraftModel.from_pretrained(path)` instead (`generation_hook.py`)."""

from __future__ import annotations

import torch

from ..configuration_dflash import DFlashConfig, rope_parameters_from_config


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _json_number(value):
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _rope_fields(config: DFlashConfig) -> tuple[float, dict | None]:
    """RoPE as the 4.x spelling (`rope_theta`, `rope_scaling`) that the released checkpoints, SGLang, vLLM and both
    transformers majors read (transformers 5 folds it into `rope_parameters` itself)."""
    params = rope_parameters_from_config(config)
    theta = params.pop("rope_theta")
    scaling = None if params.get("rope_type", "default") == "default" and set(params) <= {"rope_type"} else params
    return _json_number(theta), scaling


def decoder_fields(config: DFlashConfig) -> dict:
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


def require_mask_token(config: DFlashConfig) -> int:
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
    decoder = decoder_fields(config)
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "block_size": config.block_size,
        "dflash_config": {
            "mask_token_id": require_mask_token(config),
            "target_layer_ids": list(config.target_layer_ids),
            "block_size": config.block_size,
        },
        "num_target_layers": int(num_target_layers),
        **decoder,
        "dtype": dtype_name(dtype),
        "initializer_range": config.initializer_range,
    }
