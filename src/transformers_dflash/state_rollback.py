"""Hybrid targets: rolling back recurrent and convolution state after a partly accepted block (carried core).

Hybrid targets (Qwen3.5, Qwen3-Next, LFM2, Granite-MoE-hybrid, Falcon-H1) mix attention layers with linear-attention
or state-space layers that keep, per row, a fixed-size recurrent state and a short convolution state instead of a
KV cache. A verification forward over [anchor, drafts] moves those states past every drafted token; when a row
rejects some drafts, its state must go back to where plain decoding of the committed tokens would leave it, and
unlike a KV cache a recurrent state cannot be cropped.

The design (`StateRollback`): before each verification the state tensors of the non-attention layers are copied
(`snapshot`); after the commit, if the rows did not keep the whole block, the copy is restored, the attention layers
are cropped back to before the block, and the target runs once more over the committed block tokens only (anchor +
accepted drafts, `refeed`). The verified positions' features already came out of the verification forward (the
state before the block was exact, and a position's output does not depend on later tokens), so the drafter's context
is unchanged. A recurrent state cannot have holes, so batched rows of a hybrid target commit the same number of
tokens per step (`align_continuing_rows`, as for sliding windows). Costs measured: docs/hybrid.md.

Two cache layouts are handled:
- transformers 5.x: one `DynamicCache(config=...)` whose layers are `LinearAttentionCacheLayerMixin` (conv and
  recurrent state dicts), attention `DynamicLayer`s, both in one layer (`LinearAttentionAndFullAttentionLayer`), or
  `DummyLayer`s;
- transformers 4.57: Qwen3-Next's own `Qwen3NextDynamicCache` (lists `conv_states`, `recurrent_states`,
  `key_cache`, `value_cache`). That version's Gated DeltaNet restarts its state on every multi-token forward, so
  decoding runs inside `legacy_qwen3_next_continuation`, which makes a multi-token forward continue the cached state.

Only model types whose multi-token forward was checked to continue the cached state exactly are accepted
(`STATE_CONTINUING_MODEL_TYPES`, tests/test_hybrid.py); others get a ValueError naming the state and why.
"""

import contextlib
import functools

import torch
from torch import nn
from torch.nn import functional as F

from .configuration_dflash import text_config

try:  # transformers >= 5: one cache class whose layers may hold linear-attention state
    from transformers.cache_utils import DummyLayer, DynamicLayer, LinearAttentionCacheLayerMixin
except ImportError:  # transformers 4.x: hybrid models bring their own cache classes
    DummyLayer = DynamicLayer = LinearAttentionCacheLayerMixin = None

ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}
# transformers 5.x cache layers whose attention part `StateRollback.crop` crops and whose state it restores.
CROPPABLE_LAYERS = {"DynamicLayer", "LinearAttentionLayer", "LinearAttentionAndFullAttentionLayer", "DummyLayer"}

# Text model types whose multi-token forward from a cache equals the full forward over the same tokens (checked by
# tests/test_hybrid.py::test_multi_token_forward_continues_the_cached_state), per transformers major version.
STATE_CONTINUING_MODEL_TYPES = {
    5: {"qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "lfm2", "granitemoehybrid", "falcon_h1"},
    4: {"qwen3_next"},  # with `legacy_qwen3_next_continuation`
}
# Measured on transformers 5.24: after a 7-token prefill, a 5-token forward from the cache gave logits 4.6e-3
# (Bamba) and 1.9e-3 (Jamba) away from the full forward in float64, so their PyTorch Mamba path does not continue
# its state over several tokens and a block cannot be verified against it.
NON_CONTINUING = {"bamba", "jamba"}


def _major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def has_recurrent_state(target: nn.Module) -> bool:
    """Whether the target keeps per-row state besides a KV cache (linear attention, convolutions, SSM layers)."""
    config = text_config(target.config)
    layer_types = set(getattr(config, "layer_types", None) or [])
    return bool(getattr(target, "_is_stateful", False) or layer_types - ATTENTION_LAYER_TYPES)


def check_state_rollback(target: nn.Module) -> None:
    """Raise a ValueError that names the state and why, when DFlash cannot roll back this target's state."""
    if not has_recurrent_state(target):
        return
    config = text_config(target.config)
    model_type = getattr(config, "model_type", type(config).__name__)
    name = type(target).__name__
    if model_type in NON_CONTINUING:
        raise ValueError(
            f"{name} keeps Mamba recurrent and convolution state, and transformers' {model_type} layers do not "
            "continue that state over a forward of several new tokens (a verified block gives other logits than "
            "plain decoding), so DFlash cannot verify drafts for it. Generate without assistant_model."
        )
    if model_type not in STATE_CONTINUING_MODEL_TYPES.get(_major(), set()):
        if _major() < 5:
            raise ValueError(
                f"{name} keeps recurrent state in its own transformers 4.x cache, which DFlash can roll back only for "
                "Qwen3-Next. Upgrade transformers (>= 5.x, tested with 5.24: hybrid caches expose their conv and "
                "recurrent states there), or generate without assistant_model."
            )
        raise ValueError(
            f"{name} ({model_type}) keeps recurrent or convolution state that DFlash has not checked it can roll back: "
            "verification needs a multi-token forward that continues the cached state exactly. Supported hybrid "
            f"targets: {sorted(STATE_CONTINUING_MODEL_TYPES[5])}. Generate without assistant_model."
        )


def new_hybrid_cache(target: nn.Module):
    """An empty cache for a hybrid target whose attention layers can be cropped after rejected drafts."""
    check_state_rollback(target)
    if LinearAttentionCacheLayerMixin is None:
        import importlib

        module = importlib.import_module(type(target).__module__)
        return module.Qwen3NextDynamicCache(text_config(target.config))
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=target.config)
    for i, layer in enumerate(cache.layers):
        if type(layer).__name__ == "DynamicSlidingWindowLayer":
            # Sliding layers measure their window in positions through the mask (as for attention-only targets), and
            # a full layer can be cropped anywhere.
            cache.layers[i] = DynamicLayer()
        elif type(layer).__name__ not in CROPPABLE_LAYERS:
            raise ValueError(
                f"Layer {i} of {type(target).__name__}'s cache is a {type(layer).__name__}, which DFlash cannot crop "
                "or roll back after rejected drafts. Generate without assistant_model."
            )
    return cache


def continues_hybrid_cache(target: nn.Module, cache) -> bool:
    """Whether DFlash can decode into the caller's cache of a hybrid target (transformers >= 5): the unified cache
    plain `generate()` builds for it, every attention layer croppable (no sliding-window layer, whose window is kept
    by dropping slots) and its recurrent state restorable. transformers 4.57's own hybrid caches are not continued."""
    if LinearAttentionCacheLayerMixin is None:
        return False
    check_state_rollback(target)
    layers = getattr(cache, "layers", ())
    return bool(layers) and all(type(layer).__name__ in CROPPABLE_LAYERS for layer in layers)


class StateRollback:
    """Snapshot / restore of a hybrid target cache's recurrent and convolution state, and the attention-layer
    operations (crop, row selection) that `cache.crop` / `cache.batch_select_indices` cannot do on such a cache."""

    def __init__(self, cache):
        self.cache = cache
        self.legacy = LinearAttentionCacheLayerMixin is None
        self._saved: list[torch.Tensor] = []

    @classmethod
    def for_target(cls, target: nn.Module, cache) -> "StateRollback | None":
        return cls(cache) if has_recurrent_state(target) else None

    def _state_slots(self) -> list[tuple[object, object]]:
        """(container, key) of every state tensor: `container[key]` is the tensor."""
        if self.legacy:
            return [
                (states, i)
                for states in (self.cache.conv_states, self.cache.recurrent_states)
                for i, t in enumerate(states)
                if isinstance(t, torch.Tensor) and t.numel()
            ]
        slots = []
        for layer in self.cache.layers:
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                for states in (layer.conv_states, layer.recurrent_states):
                    slots.extend((states, i) for i, t in states.items() if t is not None)
        return slots

    def snapshot(self) -> None:
        """Copy the state the next forward will move (into buffers reused from step to step)."""
        saved = []
        for j, (container, key) in enumerate(self._state_slots()):
            live = container[key]
            buffer = self._saved[j] if j < len(self._saved) else None
            if buffer is None or buffer.shape != live.shape:
                buffer = live.clone()
            else:
                buffer.copy_(live)
            saved.append(buffer)
        self._saved = saved

    def restore(self) -> None:
        for (container, key), saved in zip(self._state_slots(), self._saved):
            if container[key].shape == saved.shape:
                container[key].copy_(saved)
            else:
                container[key] = saved.clone()

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` slots of the attention layers (recurrent state is restored instead)."""
        if tokens_to_remove == 0:
            return
        if self.legacy:
            for i in self.cache.transformer_layers:
                if self.cache.key_cache[i] is not None:
                    self.cache.key_cache[i] = self.cache.key_cache[i][..., :tokens_to_remove, :]
                    self.cache.value_cache[i] = self.cache.value_cache[i][..., :tokens_to_remove, :]
            return
        for layer in self.cache.layers:
            if isinstance(layer, DynamicLayer):
                DynamicLayer.crop(layer, tokens_to_remove)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows `indices` in every layer (finished rows leave the batch)."""
        if self.legacy:
            for states in (
                self.cache.key_cache,
                self.cache.value_cache,
                self.cache.conv_states,
                self.cache.recurrent_states,
            ):
                for i, t in enumerate(states):
                    if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] > 0:
                        states[i] = t[indices.to(t.device)]
        else:
            for layer in self.cache.layers:
                if isinstance(layer, DynamicLayer):
                    DynamicLayer.batch_select_indices(layer, indices)
                if isinstance(layer, LinearAttentionCacheLayerMixin):
                    for states in (layer.conv_states, layer.recurrent_states):
                        for i, t in states.items():
                            if t is not None:
                                states[i] = t[indices.to(t.device)]
        self._saved = []

    def settle(self, target_forward, candidates, block_positions, mask, num_new: list[int], keep: list[int]) -> None:
        """After the commit of a verified block `candidates` (its attention slots already cropped to the ones the
        rows keep): when the rows keep fewer than the whole block, restore the state from before the block, crop the
        attention layers back to it, and run the target over the kept tokens only. `block_positions` are the target's
        (`[rows, n]`, or `[axes, rows, n]` for multimodal RoPE); `mask` covers the cache slots up to and including the
        kept ones; the continuing rows `keep` keep the same number of tokens (aligned rows)."""
        kept = max(num_new[i] for i in keep)
        if kept == candidates.shape[1]:
            return  # every verified token stays: the state after verification is the right one
        self.restore()
        self.crop(-kept)
        target_forward(candidates[:, :kept], block_positions[..., :kept], mask, 1)

    def settle_last(self, target_forward, candidates, block_positions, kept: int) -> None:
        """After the last block of a single prompt (no row continues, so its slots were not cropped): leave the cache
        as plain decoding leaves it, every committed token read but the last, so that it can be passed to the next
        generate() call of a conversation. The rejected drafts after an EOS or the length limit leave the state."""
        width = candidates.shape[1]
        if kept == width:
            return
        self.crop(-(width - kept))
        self.settle(target_forward, candidates, block_positions, None, [kept], [0])


@contextlib.contextmanager
def legacy_qwen3_next_continuation(target: nn.Module):
    """transformers 4.57's `Qwen3NextGatedDeltaNet` starts from a zero state on every forward of more than one token
    (it was written for prefill + one-token decoding). Inside this block a multi-token forward over a cache that
    already holds state continues it instead: the causal convolution sees the cached inputs before the new ones, and
    the chunked delta rule starts from the cached recurrent state. One-token forwards and the prefill are untouched."""
    if LinearAttentionCacheLayerMixin is not None:
        yield
        return
    modules = [m for m in target.modules() if type(m).__name__ == "Qwen3NextGatedDeltaNet"]
    handles, originals = [], []
    for module in modules:
        conv_fn, chunk_fn = module.causal_conv1d_fn, module.chunk_gated_delta_rule
        originals.append((module, conv_fn, chunk_fn))
        module.causal_conv1d_fn = functools.partial(_continuing_conv, module, conv_fn)
        module.chunk_gated_delta_rule = functools.partial(_continuing_chunk, module, chunk_fn)
        handles.append(module.register_forward_pre_hook(_stash_state, with_kwargs=True))
        handles.append(module.register_forward_hook(_drop_stash))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for module, conv_fn, chunk_fn in originals:
            module.causal_conv1d_fn, module.chunk_gated_delta_rule = conv_fn, chunk_fn
            module.__dict__.pop("_dflash_stash", None)


def _stash_state(module, args, kwargs):
    hidden_states = kwargs.get("hidden_states", args[0] if args else None)
    cache = kwargs.get("cache_params")
    module._dflash_stash = None
    if cache is not None and cache.has_previous_state and hidden_states.shape[1] > 1:
        i = module.layer_idx
        module._dflash_stash = (cache, cache.conv_states[i], cache.recurrent_states[i])


def _drop_stash(module, args, output):
    module._dflash_stash = None


def _continuing_conv(module, original, x, weight, bias=None, activation=None, seq_idx=None):
    stash = getattr(module, "_dflash_stash", None)
    if stash is None:  # the layer's own path: its kernel, or the padded nn.Conv1d
        if original is not None:
            return original(x=x, weight=weight, bias=bias, activation=activation, seq_idx=seq_idx)
        return F.silu(module.conv1d(x)[:, :, : x.shape[-1]])
    cache, conv_state, _ = stash
    full = torch.cat([conv_state.to(x.dtype), x], dim=-1)
    cache.conv_states[module.layer_idx] = full[..., -conv_state.shape[-1] :]
    out = F.conv1d(full, weight.unsqueeze(1), bias, groups=full.shape[1])[..., -x.shape[-1] :]
    return F.silu(out)


def _continuing_chunk(module, original, *args, initial_state=None, **kwargs):
    stash = getattr(module, "_dflash_stash", None)
    if stash is not None:
        initial_state = stash[2]
    return original(*args, initial_state=initial_state, **kwargs)
