"""A KV cache for batched `generate()` that writes new keys and values into room reserved up front.

transformers' `DynamicLayer` grows by `torch.cat`, which copies a layer's whole cache at every decoding step. For one
sequence that is cheap; for the regeneration engine's batches it dominated a bfloat16 step on a CPU (profile and
timings: docs/data-engines.md). The keys and values seen by attention are the same tensors either way (views of a
longer buffer here), so the outputs are identical.
"""

from __future__ import annotations

import inspect
from typing import Any


def reserved_kv_cache(model: Any, capacity: int) -> Any | None:
    """A `DynamicCache` for `model` whose full-attention layers reserve `capacity` positions (prompt + new tokens).

    Returns None where the layer API is not the one this was written against (transformers before 4.56, which had
    no cache layers): `generate()` then builds its own cache, only slower.
    """
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer
    except ImportError:
        return None
    reserved_layer = _reserved_layer_class(DynamicLayer)
    try:
        cache = DynamicCache(config=model.config)
    except TypeError:  # a DynamicCache without `config`
        return None
    layers = getattr(cache, "layers", None)
    if not layers:  # layers made lazily (no config to read them from): leave the cache as transformers makes it
        return None
    cache.layers = [reserved_layer(capacity) if type(layer) is DynamicLayer else layer for layer in layers]
    return cache


_CLASSES: dict[type, type] = {}


def _reserved_layer_class(dynamic_layer: type) -> type:
    """The `DynamicLayer` subclass that fills reserved room, built once per transformers `DynamicLayer` class."""
    if dynamic_layer in _CLASSES:
        return _CLASSES[dynamic_layer]
    # transformers 4.57 initialises a layer from the keys alone, 5.x from keys and values
    initialised_from_values = "value_states" in inspect.signature(dynamic_layer.lazy_initialization).parameters

    class ReservedDynamicLayer(dynamic_layer):
        """`DynamicLayer` whose `keys`/`values` are views of buffers with room for `capacity` positions.

        Everything else of `DynamicLayer` (crop, batch selection, beam reordering) works on `keys`/`values` as usual;
        when they no longer view the buffers (replaced by such an operation), or the room runs out, `update` copies
        them into new buffers once and goes on from there.
        """

        def __init__(self, capacity: int) -> None:
            super().__init__()
            self.capacity = int(capacity)
            self._key_buffer = self._value_buffer = None

        def _views_buffers(self, batch: int) -> bool:
            buffer = self._key_buffer
            return (
                buffer is not None
                and buffer.shape[0] == batch
                and (self.keys.numel() == 0 or self.keys.data_ptr() == buffer.data_ptr())
            )

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                if initialised_from_values:
                    self.lazy_initialization(key_states, value_states)
                else:
                    self.lazy_initialization(key_states)
            length = self.get_seq_length()
            end = length + key_states.shape[-2]
            if not self._views_buffers(key_states.shape[0]) or end > self._key_buffer.shape[-2]:
                room = max(self.capacity, end) if length == 0 else max(2 * length, end)
                keys = key_states.new_empty(*key_states.shape[:-2], room, key_states.shape[-1])
                values = value_states.new_empty(*value_states.shape[:-2], room, value_states.shape[-1])
                if length:
                    keys[..., :length, :] = self.keys
                    values[..., :length, :] = self.values
                self._key_buffer, self._value_buffer = keys, values
            self._key_buffer[..., length:end, :] = key_states
            self._value_buffer[..., length:end, :] = value_states
            self.keys = self._key_buffer[..., :end, :]
            self.values = self._value_buffer[..., :end, :]
            return self.keys, self.values

        def reset(self) -> None:
            self._key_buffer = self._value_buffer = None
            super().reset()

    _CLASSES[dynamic_layer] = ReservedDynamicLayer
    return ReservedDynamicLayer
