"""The vLLM speculators format (`speculators_model_type: "dflash"`), which `vllm serve` reads directly.
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

Reading refuses what DFlash-here cannot represent rather than approximating it: a reduced draft vocabulary (own lm_head
+ d2t), a hidden size different from the target's, causal sliding-window blocks, Domino heads.
"""

from __future__ import annotations

import torch

from ..configuration_dflash import DFlashConfig, decoder_shape_kwargs, rope_parameters_from_config
from .released import decoder_fields, dtype_name, require_mask_token
from .target import TargetInfo

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
        **decoder_fields(config),
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
        "mask_token_id": require_mask_token(config),
        "sliding_window_non_causal": True,
        "dtype": dtype_name(dtype),
    }
    if num_target_layers is not None:
        out["num_target_layers"] = int(num_target_layers)
    return out


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
    skipped = {
        "model_type",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "architectures",
        "auto_map",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "_name_or_path",
    }
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
