"""The hook that routes `target.generate(input_ids, assistant_model=drafter)` to DFlash decoding (carried core).

`install_generation_hook(drafter_class)` wraps two methods of transformers' `GenerationMixin` once, and registers
which decoding code serves drafters of `drafter_class`:

- `generate`: checks that the drafter fits the target and refuses what DFlash cannot do (beam search, several
  return sequences, image inputs for a text-only target), with messages that say how to fix the call;
- `_assisted_decoding`: runs `dflash_decoding` instead of transformers' batch-1 assisted loop.

A DFlash drafter checkpoint loaded by other code (its config carries a `dflash_config` but its class is not
registered) is handed to the first registered class that offers `from_released_model`: z-lab's own `dflash.py` class
is adopted (our drafter holding its very weights decodes, and its `last_acceptance_lengths` are set on it too), and a
released folder loaded as a plain transformers model (`Qwen3Model`, which dropped the drafter's weights) is refused
before transformers runs, with the call to make instead.

Every other assistant (a classic assistant model, prompt lookup, ...) keeps transformers' own behaviour. The
registry lives on `GenerationMixin`, so a drafter loaded with `trust_remote_code` runs the code saved next to it even
when another copy of this package installed the wrappers first.
"""

import functools

import torch
from torch import nn

from .decoding import check_padding, dflash_decoding
from .target_model import check_drafter_fits_target, check_media_inputs, is_media_input


def prepare_generate_kwargs(drafter: nn.Module, target: nn.Module, args: tuple, kwargs: dict) -> dict:
    """Checks run by the `generate` hook before transformers' own, so errors name the DFlash-specific fix."""
    check_drafter_fits_target(drafter, target)
    if kwargs.get("inputs_embeds") is not None:
        raise ValueError(
            "DFlash decoding needs token ids (the drafter embeds its blocks with the target's embedding table); pass "
            "input_ids instead of inputs_embeds."
        )
    check_media_inputs(target, sorted(k for k, v in kwargs.items() if v is not None and is_media_input(k)))
    inputs = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    if isinstance(inputs, torch.Tensor) and inputs.dim() == 2:
        check_padding(kwargs.get("attention_mask"), inputs)
    generation_config = kwargs.get("generation_config") or target.generation_config
    num_beams = kwargs.get("num_beams", getattr(generation_config, "num_beams", 1)) or 1
    if num_beams > 1:
        raise ValueError(
            f"Beam search (num_beams={num_beams}) cannot be combined with a DFlash drafter: speculative decoding "
            "verifies one sequence per prompt. Use num_beams=1 (greedy or sampling), or drop assistant_model."
        )
    num_return = kwargs.get("num_return_sequences", getattr(generation_config, "num_return_sequences", 1)) or 1
    if num_return > 1:
        raise ValueError(
            f"num_return_sequences={num_return} cannot be combined with a DFlash drafter. Repeat the prompt in the "
            "batch instead (input_ids.repeat(n, 1)) to get several samples."
        )
    implementation = kwargs.get("cache_implementation", getattr(generation_config, "cache_implementation", None))
    if implementation not in (None, "dynamic", "dynamic_full"):
        raise ValueError(
            f"cache_implementation={implementation!r} cannot be cropped after rejected drafts; DFlash decoding needs a "
            "dynamic cache. Remove `cache_implementation` from the generate() call or generation config."
        )
    if kwargs.get("speculation_type") == "dflash":
        kwargs = dict(kwargs)
        # transformers' own DFlash path expects its built-in drafter class; ours runs through `_assisted_decoding`.
        kwargs.pop("speculation_type")
    if kwargs.get("assistant_tokenizer") is not None:
        kwargs = dict(kwargs)
        assistant_tokenizer, tokenizer = kwargs.pop("assistant_tokenizer"), kwargs.get("tokenizer")
        # A drafter drafts the target's own token ids. pipeline(..., assistant_model=drafter) asks for an
        # assistant_tokenizer where the drafter's config names other special tokens than the target's (drafters saved
        # before the config kept pad_token_id), and generate() refuses one for a drafter of the same vocabulary.
        if tokenizer is not None and len(assistant_tokenizer) != len(tokenizer):
            raise ValueError(
                f"A DFlash drafter drafts in the target's own token ids, but assistant_tokenizer has "
                f"{len(assistant_tokenizer)} tokens and the target's tokenizer {len(tokenizer)}. Omit "
                "assistant_tokenizer (pass the target's tokenizer as tokenizer=), or use the drafter trained for this "
                "target."
            )
    return kwargs


def _implementation(assistant_model):
    """(prepare_generate_kwargs, dflash_decoding) registered for the drafter's class, or None for other assistants."""
    from transformers.generation.utils import GenerationMixin

    registry = getattr(GenerationMixin, "_dflash_implementations", {})
    return next((registry[c] for c in type(assistant_model).__mro__ if c in registry), None)


def _dflash_drafter(assistant_model):
    """(drafter, implementation) that serves `assistant_model`, or None for assistants that are not DFlash drafters.

    A registered drafter serves itself. A DFlash checkpoint loaded by other code (its config carries a
    `dflash_config`) is turned into a drafter by the first registered class that offers `from_released_model`, which
    raises a ValueError for a model that cannot draft (a released folder loaded as a plain `Qwen3Model`)."""
    from transformers.generation.utils import GenerationMixin

    implementation = _implementation(assistant_model)
    if implementation is not None:
        return assistant_model, implementation
    if not isinstance(getattr(getattr(assistant_model, "config", None), "dflash_config", None), dict):
        return None
    for drafter_class, implementation in getattr(GenerationMixin, "_dflash_implementations", {}).items():
        if hasattr(drafter_class, "from_released_model"):
            return drafter_class.from_released_model(assistant_model), implementation
    return None


def install_generation_hook(drafter_class: type) -> None:
    """Route `generate(..., assistant_model=<drafter_class instance>)` to this file's DFlash decoding. Idempotent."""
    from transformers.generation.utils import GenerationMixin

    if not hasattr(GenerationMixin, "_dflash_implementations"):
        GenerationMixin._dflash_implementations = {}
    GenerationMixin._dflash_implementations[drafter_class] = (prepare_generate_kwargs, dflash_decoding)
    if getattr(GenerationMixin, "_dflash_hook_installed", False):
        return
    original_generate = GenerationMixin.generate
    original_assisted_decoding = GenerationMixin._assisted_decoding

    @functools.wraps(original_generate)
    def generate(self, *args, **kwargs):
        assistant = kwargs.get("assistant_model")
        served = _dflash_drafter(assistant)
        if served is None:
            return original_generate(self, *args, **kwargs)
        drafter, implementation = served
        kwargs = dict(implementation[0](drafter, self, args, kwargs), assistant_model=drafter)
        try:
            # transformers refuses assisted generation for every stateful model; the checks above accepted this one,
            # whose recurrent state DFlash decoding rolls back (state_rollback.py). Lift the flag for this call only.
            if not getattr(self, "_is_stateful", False):
                return original_generate(self, *args, **kwargs)
            self._is_stateful = False
            try:
                return original_generate(self, *args, **kwargs)
            finally:
                del self._is_stateful
        finally:
            if drafter is not assistant:  # an adopted drafter: its statistics are read on the model the user passed
                assistant.last_acceptance_lengths = getattr(drafter, "last_acceptance_lengths", [])

    @functools.wraps(original_assisted_decoding)
    def _assisted_decoding(self, input_ids, *args, assistant_model=None, **kwargs):
        implementation = _implementation(assistant_model)
        if implementation is None:
            return original_assisted_decoding(self, input_ids, *args, assistant_model=assistant_model, **kwargs)
        for name in ("inputs_tensor", "assistant_tokenizer", "tokenizer"):
            kwargs.pop(name, None)
        return implementation[1](self, assistant_model, input_ids, *args, **kwargs)

    GenerationMixin.generate = generate
    GenerationMixin._assisted_decoding = _assisted_decoding
    GenerationMixin._dflash_hook_installed = True
    GenerationMixin._dflash_original_methods = {
        "generate": original_generate,
        "_assisted_decoding": original_assisted_decoding,
    }
