"""What DFlash decoding needs to know about a target model (part of the carried core: torch and transformers only).

Where its decoder layers are, which forward keyword takes the cache (renamed in transformers 5.24), whether it has
sliding-window layers, a fresh cache that can be cropped after rejected drafts, the checks that a drafter fits it, and
which image / video inputs of a prompt it takes (`check_media_inputs`, `prompt_inputs`).
"""

import functools
import inspect

from torch import nn

from .configuration_dflash import text_config
from .state_rollback import check_state_rollback, continues_hybrid_cache, has_recurrent_state, new_hybrid_cache


def decoder_layers(target: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(target).__name__} does not expose its decoder layers as `get_decoder().layers`; DFlash needs a "
            "decoder-only transformers model (Llama, Qwen2/3, Mistral, Gemma, ...) loaded with AutoModelForCausalLM."
        )
    return decoder, layers


def feature_modules(target: nn.Module, layer_ids) -> list[nn.Module]:
    """The modules whose outputs are the drafter's context features: transformers' `hidden_states[i + 1]` for i in
    `layer_ids` is the output of decoder layer i, except for the last layer, whose entry is the final-normed output
    (so the final norm there). Hooking these keeps only their outputs, where `output_hidden_states=True` keeps every
    layer's."""
    decoder, layers = decoder_layers(target)
    last = len(layers) - 1
    return [decoder.norm if i == last and hasattr(decoder, "norm") else layers[i] for i in layer_ids]


def keep_outputs(modules: list[nn.Module], store: list) -> list:
    """Forward hooks that put each module's output in `store[slot]` at every forward; returns their handles (the
    caller removes them with `remove_hooks`)."""
    return [
        module.register_forward_hook(functools.partial(_keep_output, store, slot))
        for slot, module in enumerate(modules)
    ]


def _keep_output(store: list, slot: int, module, args, output):
    store[slot] = output[0] if isinstance(output, tuple) else output


def remove_hooks(handles: list) -> None:
    for handle in handles:
        handle.remove()


def check_drafter_fits_target(drafter: nn.Module, target: nn.Module) -> None:
    """Raise a ValueError that says what to fix when `drafter` cannot draft for `target`.

    A drafter on another device or in another dtype than the target is fine: `DFlashCandidateGenerator` moves the
    small per-step tensors across (a float32 drafter next to a bfloat16 target is a common training set-up)."""
    config = drafter.config
    target_config = text_config(target.config)
    if getattr(target.config, "is_encoder_decoder", False):
        raise ValueError("DFlash drafters need a decoder-only target; this target is an encoder-decoder model.")
    check_state_rollback(target)  # hybrid targets: their recurrent state must be restorable (state_rollback.py)
    _, layers = decoder_layers(target)
    embeddings, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    if lm_head is None:
        raise ValueError(f"{type(target).__name__} has no LM head; load the target with AutoModelForCausalLM.")
    if config.hidden_size != target_config.hidden_size:
        raise ValueError(
            f"The drafter's hidden_size is {config.hidden_size} but the target's is {target_config.hidden_size}: this "
            "drafter was built for another target. Use a drafter trained for this target, or build one with "
            "DFlashDraftModel.from_target(target)."
        )
    vocab_rows = embeddings.weight.shape[0]
    if config.vocab_size != vocab_rows:
        raise ValueError(
            f"The drafter's vocab_size is {config.vocab_size} but the target's embedding table has {vocab_rows} rows: "
            "the drafter borrows the target's embeddings and LM head, so both must use the same vocabulary."
        )
    if config.mask_token_id is None or not 0 <= config.mask_token_id < vocab_rows:
        raise ValueError(
            f"mask_token_id={config.mask_token_id} is not a row of the target's embedding table (0..{vocab_rows - 1}). "
            "Set `drafter.config.mask_token_id` to the id the drafter was trained with."
        )
    num_layers = len(layers)
    bad = [i for i in config.target_layer_ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"target_layer_ids {bad} are out of range for a target with {num_layers} layers (valid: 0..{num_layers - 1})."
        )
    if config.num_target_layers is not None and config.num_target_layers != num_layers:
        raise ValueError(
            f"This drafter was trained for a target with {config.num_target_layers} layers, but the target has "
            f"{num_layers}: it is not this target's drafter."
        )
    expected_in = len(config.target_layer_ids) * config.hidden_size
    if drafter.fc.in_features != expected_in:
        raise ValueError(
            f"The drafter's fc expects {drafter.fc.in_features} input features but {len(config.target_layer_ids)} "
            f"target layers x hidden {config.hidden_size} give {expected_in}: target_layer_ids do not match the weights."
        )


def cache_keyword(target: nn.Module) -> str:
    """transformers 5.24 renamed the forward keyword `past_key_values` to `cache`."""
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


def new_target_cache(target: nn.Module, model_kwargs: dict, generation_config, batch_size: int):
    """The target's cache for DFlash decoding, and how many prompt tokens it already holds.

    Every layer of it can be cropped after a rejected draft: a dynamic cache of full-attention layers (sliding-window
    targets still attend within their window: their masks come from the config, not the cache), or, for hybrid
    targets, their own layout, whose recurrent state `StateRollback` restores instead.

    The caller's DynamicCache is filled, as plain `generate()` fills it, where the batch is one prompt and every layer
    of the cache can be cropped (full attention) or rolled back (a hybrid target's recurrent state, transformers >= 5):
    then it may already hold the prompt's first tokens (a cached prefix, or the earlier turns of a chat), which the
    prefill skips. Anywhere else a fresh cache is used, and a pre-filled one is refused: a batch leaves holes in the
    cache where rows accepted fewer drafts, and sliding-window layers keep their window by dropping slots.
    """
    from transformers.cache_utils import DynamicCache, DynamicLayer

    given = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if given is not None and not isinstance(given, DynamicCache):
        raise ValueError(
            f"DFlash decoding needs a cache it can crop after rejected drafts; {type(given).__name__} cannot be "
            "cropped. Pass a DynamicCache, or no cache object (one is created for you)."
        )
    implementation = getattr(generation_config, "cache_implementation", None)
    if implementation not in (None, "dynamic", "dynamic_full"):
        raise ValueError(
            f"cache_implementation={implementation!r} cannot be cropped after rejected drafts; DFlash decoding needs a "
            "dynamic cache. Remove `cache_implementation` from the generate() call or generation config."
        )
    recurrent = has_recurrent_state(target)
    if recurrent:
        croppable = given is not None and continues_hybrid_cache(target, given)
    else:
        croppable = not has_sliding_window(target) and all(
            type(layer) is DynamicLayer for layer in getattr(given, "layers", ())
        )
    if given is not None and batch_size == 1 and croppable:
        return given, given.get_seq_length()
    if given is not None and given.get_seq_length() > 0:
        raise ValueError(
            "DFlash decoding continues from a pre-filled cache only for a single prompt on a target without "
            "sliding-window layers (full attention, or a hybrid target's linear-attention layers with transformers "
            ">= 5). Pass the full prompt without `past_key_values`/`cache` instead: the target then reads the whole "
            "prompt once."
        )
    if recurrent:
        return new_hybrid_cache(target), 0  # attention layers croppable, recurrent state restored (state_rollback.py)
    return DynamicCache(), 0


# The inputs every DFlash forward sets itself; `prompt_inputs` passes the prefill whatever else generate() prepared.
OWN_FORWARD_INPUTS = {
    "input_ids",
    "inputs_embeds",
    "attention_mask",
    "position_ids",
    "cache",
    "past_key_values",
    "cache_position",
    "use_cache",
    "logits_to_keep",
    "return_dict",
    "output_attentions",
    "output_hidden_states",
}


def is_media_input(name: str) -> bool:
    """Multimodal inputs of transformers' vision / audio models (pixel_values, image_grid_thw, input_features, ...)."""
    return name.startswith(
        ("pixel_values", "image_", "video_", "audio_", "input_features", "mm_encoder_outputs")
    ) or name.endswith("_grid_thw")


def generate_prepares_position_ids() -> bool:
    """transformers >= 5: generate() computes the prompt's position ids (Qwen-VL models: their multimodal RoPE ids)
    before decoding and hands them to the decoding loop in `model_kwargs["position_ids"]`; 4.x made them per step."""
    from transformers.generation.utils import GenerationMixin

    return hasattr(GenerationMixin, "_prepare_position_ids_for_generation")


def check_media_inputs(target: nn.Module, names: list[str]) -> None:
    """Raise a ValueError that says what to change when DFlash cannot decode a prompt with the media inputs `names`.

    DFlash feeds them to the target's prefill only and continues the position ids generate() prepared for the prompt;
    that is plain generate() itself for a target that takes them in its forward and whose later decoding steps need
    nothing else (it keeps GenerationMixin's own per-step input preparation)."""
    if not names:
        return
    name = type(target).__name__
    accepted = set(inspect.signature(target.forward).parameters)
    missing = [n for n in names if n not in accepted]
    if missing:
        raise ValueError(
            f"{name}.forward takes no {missing}: it is a text-only model, so the image / video / audio part of this "
            "prompt would be lost. Load the vision-language model as the target (for Qwen3.5: "
            "Qwen3_5ForConditionalGeneration, or AutoModelForImageTextToText), or drop "
            f"{missing} for a text prompt."
        )
    if not generate_prepares_position_ids():
        raise ValueError(
            f"Image / video inputs ({names}) with a DFlash drafter need transformers >= 5, whose generate() prepares "
            "the prompt's (multimodal) position ids that DFlash decoding continues. Upgrade transformers, or "
            "generate without assistant_model."
        )
    from transformers.generation.utils import GenerationMixin

    overridden = [
        m
        for m in ("prepare_inputs_for_generation", "_update_model_kwargs_for_generation")
        if getattr(type(target), m) is not getattr(GenerationMixin, m)
    ]
    if overridden:
        raise ValueError(
            f"{name} overrides {overridden}: its decoding steps after an image / video prompt take inputs of their "
            f"own, which DFlash does not reproduce. Generate without assistant_model for {names}."
        )


def _given(value) -> bool:
    return value is not None and not (isinstance(value, dict) and not value)  # generate() leaves {} for no media


def prompt_inputs(target: nn.Module, model_kwargs: dict) -> dict:
    """For a prompt with images / video: the other inputs generate() prepared for it (`model_kwargs`: the pixels or
    their pre-encoded `mm_encoder_outputs`, grids, token types, ...) that the target's forward takes, for the prefill
    forward only, as plain generate() gives its first forward. {} for a text prompt.

    Later forwards verify text tokens with ids, position ids, mask and cache only. transformers drops the media
    inputs after the prefill too; what else it keeps passing (token types, video timings) only places the prompt's
    media, in the Qwen-VL models through their position ids when none are given, which DFlash always gives. Targets
    that prepare their decoding steps' inputs themselves are refused (`check_media_inputs`)."""
    if not any(is_media_input(key) and _given(value) for key, value in model_kwargs.items()):
        return {}
    accepted = set(inspect.signature(target.forward).parameters)
    return {
        key: value
        for key, value in model_kwargs.items()
        if key in accepted and key not in OWN_FORWARD_INPUTS and _given(value)
    }


def has_sliding_window(target: nn.Module) -> bool:
    config = text_config(target.config)
    if getattr(config, "sliding_window", None) is None or getattr(config, "use_sliding_window", True) is False:
        return False
    layer_types = getattr(config, "layer_types", None)
    return layer_types is None or "sliding_attention" in layer_types
