"""The drafter's incremental context cache gives the same block outputs as one forward over the whole context."""

import copy

import pytest
import torch
from conftest import make_drafter, make_target

from transformers_dflash import DFlashDrafterCache


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("sliding", [False, True])
def test_cached_drafting_equals_full_context(attn, sliding):
    target = make_target("qwen3")
    extra = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5) if sliding else {}
    drafter = make_drafter(target, block_size=4, **extra)
    drafter.config._attn_implementation = attn
    k_features = len(drafter.config.target_layer_ids) * 32
    g = torch.Generator().manual_seed(0)
    features = torch.randn(2, 13, k_features, generator=g, dtype=torch.float64)
    block = torch.randn(2, 4, 32, generator=g, dtype=torch.float64)
    cache = DFlashDrafterCache(drafter.config.num_hidden_layers)
    start = 0
    for end in (6, 7, 11, 13):  # context arrives in uneven steps, as verified tokens do
        positions = torch.arange(start, end).expand(2, -1)
        block_positions = torch.arange(end, end + 4).expand(2, -1)
        cached = drafter(block, features[:, start:end], block_positions, positions, cache=cache).last_hidden_state
        full = drafter(block, features[:, :end], block_positions, torch.arange(end).expand(2, -1)).last_hidden_state
        torch.testing.assert_close(cached, full, rtol=1e-10, atol=1e-10)
        start = end
    assert cache.context_length == 13


def test_sliding_window_changes_what_the_block_sees():
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4, layer_types=["sliding_attention"] * 2, sliding_window=3)
    g = torch.Generator().manual_seed(0)
    features = torch.randn(1, 10, len(drafter.config.target_layer_ids) * 32, generator=g, dtype=torch.float64)
    block = torch.randn(1, 4, 32, generator=g, dtype=torch.float64)
    positions, block_positions = torch.arange(10)[None], torch.arange(10, 14)[None]
    out = drafter(block, features, block_positions, positions).last_hidden_state
    # Context rows more than `sliding_window` positions before every block row cannot matter.
    perturbed = features.clone()
    perturbed[:, :5] += 10.0
    torch.testing.assert_close(drafter(block, perturbed, block_positions, positions).last_hidden_state, out)
    perturbed[:, 9] += 10.0
    assert not torch.allclose(drafter(block, perturbed, block_positions, positions).last_hidden_state, out)


@torch.no_grad()
def test_a_mask_of_another_length_than_the_keys_is_refused():
    """SDPA cuts a longer mask to the keys' length without a word, masking the wrong slots: the drafter refuses it."""
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4)
    g = torch.Generator().manual_seed(0)
    features = torch.randn(1, 6, len(drafter.config.target_layer_ids) * 32, generator=g, dtype=torch.float64)
    block = torch.randn(1, 4, 32, generator=g, dtype=torch.float64)
    cache = DFlashDrafterCache(drafter.config.num_hidden_layers)
    drafter(block, features[:, :4], torch.arange(4, 8)[None], torch.arange(4)[None], cache=cache)
    positions, block_positions = torch.arange(4, 6)[None], torch.arange(6, 10)[None]
    fits = torch.ones(1, 1, 4, 4 + 2 + 4, dtype=torch.bool)  # [cached context ; new context ; block]
    drafter(block, features[:, 4:], block_positions, positions, attention_mask=fits, cache=copy.deepcopy(cache))
    longer = torch.ones(1, 1, 4, 12, dtype=torch.bool)
    with pytest.raises(ValueError, match="attention_mask covers 12 keys but the drafter attends over 10"):
        drafter(block, features[:, 4:], block_positions, positions, attention_mask=longer, cache=cache)
