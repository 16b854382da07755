"""transformers' built-in DFlash path (`speculation_type="dflash"`, transformers >= 5) fed our drafter's weights,
and a draft-for-draft comparison of the two paths."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from typing import Any

from .assisted import AssistedRecorder
from .drafter import core_module, draft_length, ngram_lookup

# Our (released DFlash) parameter names that `MuseGlimmerAssistantModel` keeps elsewhere.
BUILTIN_DRAFTER_RENAMES = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}


def builtin_dflash_available() -> tuple[bool, str]:
    """Whether the installed transformers has the `speculation_type="dflash"` path and its drafter class."""
    try:
        import transformers
        from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator  # noqa: F401
        from transformers.models.muse_glimmer_assistant import modeling_muse_glimmer_assistant  # noqa: F401
    except ImportError:
        import transformers

        return False, (
            f"transformers {transformers.__version__} has no built-in DFlash path "
            "(DFlashTokenCandidateGenerator / muse_glimmer_assistant arrive in 5.x)"
        )
    return True, f"transformers {transformers.__version__}"


def builtin_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Our (released DFlash) parameter names -> `MuseGlimmerAssistantModel`'s: `fc` and `hidden_norm` live in its
    `encoder` (as `encoder.fc` and `encoder.output_norm_enc`); `layers.*` and `norm` keep their names. A reduced draft
    vocabulary (`draft_vocab_ids`) has no counterpart there: the built-in path drafts from the whole vocabulary."""
    return {
        BUILTIN_DRAFTER_RENAMES.get(name, name): tensor
        for name, tensor in state_dict.items()
        if name != "draft_vocab_ids"
    }


def to_builtin_drafter(drafter):
    """A transformers `MuseGlimmerAssistantModel` with `drafter`'s exact weights and settings, for
    `target.generate(assistant_model=..., speculation_type="dflash")`. Same device, dtype and attention backend.

    The two architectures are the same computation (Qwen3-style layers with q/k-norm, KV injection of the fused
    target features, non-causal block); only the places of `fc`/`hidden_norm` and the config class differ.
    """
    import torch

    available, reason = builtin_dflash_available()
    if not available:
        raise RuntimeError(reason)
    from transformers.models.muse_glimmer_assistant.configuration_muse_glimmer_assistant import (
        MuseGlimmerAssistantConfig,
    )
    from transformers.models.muse_glimmer_assistant.modeling_muse_glimmer_assistant import MuseGlimmerAssistantModel

    c = drafter.config
    if getattr(c, "attention_bias", False):
        raise ValueError("transformers' built-in DFlash drafter has no attention biases; this drafter has some.")
    rope = dict(c.rope_parameters)
    config = MuseGlimmerAssistantConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters=rope,
        max_position_embeddings=c.max_position_embeddings,
        sliding_window=c.sliding_window if c.sliding_window is not None else c.max_position_embeddings,
        layer_types=list(c.layer_types),
        attention_dropout=c.attention_dropout,
        hidden_act=c.hidden_act,
        bos_token_id=c.bos_token_id if isinstance(c.bos_token_id, int) else None,
        eos_token_id=c.eos_token_id if isinstance(c.eos_token_id, int) else None,
        pad_token_id=None,
        block_size=c.block_size,
        mask_token_id=c.mask_token_id,
        target_layer_ids=list(c.target_layer_ids),
    )
    config._attn_implementation = getattr(c, "_attn_implementation", None) or "sdpa"
    param = next(drafter.parameters())
    with torch.device(param.device):
        model = MuseGlimmerAssistantModel(config)
    # Cast the parameters only, as `from_pretrained(dtype=...)` would: the RoPE `inv_freq` buffer stays float32
    # (`model.to(torch.bfloat16)` would round it, and the angles would drift at long positions). Casting before
    # loading keeps float64 weights exact.
    for p in model.parameters():
        p.data = p.data.to(param.dtype)
    model.load_state_dict(builtin_state_dict(drafter.state_dict()), strict=True)
    return model.eval()


@contextlib.contextmanager
def _record_our_drafts(drafter, store: list):
    generator_class = core_module(drafter, "candidate_generator").DFlashCandidateGenerator
    original = generator_class.draft

    @functools.wraps(original)
    def draft(self, *args, **kwargs):
        drafts, confidence = original(self, *args, **kwargs)
        store.append(drafts[0].tolist())
        return drafts, confidence

    generator_class.draft = draft
    try:
        yield store
    finally:
        generator_class.draft = original


def compare_drafts(target, drafter, builtin_drafter, input_ids, max_new_tokens: int = 64, **generate_kwargs) -> dict:
    """Greedy-decode `input_ids` through both DFlash paths and compare their proposals step by step.

    Both paths start a step from the same verified context when all earlier drafts agreed, so equal drafts at every
    step mean the two drafters compute the same function. Near the end our path drafts only what still fits
    (`max_new_tokens`) while the built-in one always drafts `block_size - 1` and crops afterwards: a step counts as
    equal when our drafts are a prefix of the built-in's.
    """
    import torch

    kwargs = dict(attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens, do_sample=False)
    kwargs.update(generate_kwargs)
    ours: list[list[int]] = []
    with (
        torch.inference_mode(),
        _record_our_drafts(drafter, ours),
        draft_length(drafter, "full"),
        ngram_lookup(drafter, 0),
    ):
        ours_out = target.generate(input_ids, assistant_model=drafter, **kwargs)
    ours_acceptance = list(drafter.last_acceptance_lengths)
    recorder = AssistedRecorder(record_drafts=True)
    with torch.inference_mode(), recorder.watch():
        builtin_out = target.generate(input_ids, assistant_model=builtin_drafter, speculation_type="dflash", **kwargs)
    theirs = [d for d in recorder.drafts if d]  # the built-in loop's prefill call proposes nothing
    steps = min(len(ours), len(theirs))
    equal = [ours[i] == theirs[i][: len(ours[i])] for i in range(steps)]
    first = next((i for i, ok in enumerate(equal) if not ok), None)
    detail = None
    if first is not None:
        detail = {"step": first, "ours": ours[first], "builtin": theirs[first]}
    return {
        "steps_compared": steps,
        "steps_equal": sum(equal),
        "ours_steps": len(ours),
        "builtin_steps": len(theirs),
        "first_difference": detail,
        "outputs_equal": ours_out[0].tolist() == builtin_out[0].tolist(),
        "ours_acceptance": ours_acceptance,
        "builtin_acceptance": recorder.acceptance,
        "all_equal": first is None and len(ours) == len(theirs),
    }
