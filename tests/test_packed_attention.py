"""Grouped attention over packed blocks (training/packed_attention.py): the dense masked attention's result, forward
and backward, with fewer keys; and a dense fallback wherever grouping would not be exact."""

import pytest
import torch
from test_training import tiny_drafter, tiny_target

from transformers_dflash.training import build_block_attention_mask, dflash_loss, packed_attention
from transformers_dflash.training.blocks import sample_anchors

pytestmark = pytest.mark.usefixtures("one_thread")
# float64 throughout, but eager attention takes its softmax in float32 (as transformers' does)
CLOSE = {"rtol": 1e-5, "atol": 1e-6}


def _attention(drafter, implementation, mask, rows_per_group, monkeypatch, seed=0):
    """One drafter layer's attention on random queries / keys / values under `mask`: (output, their gradients)."""
    monkeypatch.setattr(packed_attention, "ROWS_PER_GROUP", rows_per_group)
    attention = drafter.layers[0].self_attn
    generator = torch.Generator().manual_seed(seed)
    batch, _, rows, keys = mask.shape
    heads, kv_heads, dim = drafter.config.num_attention_heads, drafter.config.num_key_value_heads, attention.head_dim
    query = torch.randn(batch, heads, rows, dim, generator=generator, dtype=torch.float64, requires_grad=True)
    key = torch.randn(batch, kv_heads, keys, dim, generator=generator, dtype=torch.float64, requires_grad=True)
    value = torch.randn(batch, kv_heads, keys, dim, generator=generator, dtype=torch.float64, requires_grad=True)
    drafter.config._attn_implementation = implementation
    with packed_attention.grouped_block_attention(drafter):
        function = packed_attention.ALL_ATTENTION_FUNCTIONS[drafter.config._attn_implementation]
        output, _ = function(attention, query, key, value, mask, scaling=dim**-0.5, dropout=0.0, is_causal=False)
    assert drafter.config._attn_implementation == implementation  # restored
    output.backward(torch.randn(output.shape, generator=generator, dtype=torch.float64))
    return output.detach(), [t.grad for t in (query, key, value)]


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_grouped_attention_is_the_dense_attention(implementation, monkeypatch):
    drafter = tiny_drafter(tiny_target()).double()
    block_size = drafter.config.block_size
    loss_mask = torch.zeros(3, 40, dtype=torch.bool)
    loss_mask[:, 6:] = True
    loss_mask[1, 30:] = False  # a shorter sequence: fewer anchors, padding blocks
    anchors, _ = sample_anchors(loss_mask, 7, block_size, torch.Generator().manual_seed(3))
    mask = build_block_attention_mask(anchors, 40, block_size)
    calls = []
    real_groups = packed_attention._groups
    monkeypatch.setattr(packed_attention, "_groups", lambda *a: calls.append(real_groups(*a)) or calls[-1])
    dense, dense_grads = _attention(drafter, implementation, mask, 10**6, monkeypatch)
    for rows_per_group in (block_size, 2 * block_size, 3 * block_size + 1):
        grouped, grads = _attention(drafter, implementation, mask, rows_per_group, monkeypatch)
        torch.testing.assert_close(grouped, dense, **CLOSE)
        for grad, dense_grad in zip(grads, dense_grads):
            torch.testing.assert_close(grad, dense_grad, **CLOSE)
    assert calls[0] is None and all(groups is not None for groups in calls[1:])  # grouped where asked
    first, _, context_kept = calls[1][0]
    assert first == 0 and context_kept == int(anchors[:, 0].max()) < 40  # the first block sees the least context


def test_grouping_falls_back_to_dense_where_it_would_not_be_exact(monkeypatch):
    drafter = tiny_drafter(tiny_target()).double()
    block_size = drafter.config.block_size
    anchors = torch.tensor([[4, 9, 15, 22]])
    mask = build_block_attention_mask(anchors, 30, block_size)
    mask[0, 0, 0, 30 + 3 * block_size] = True  # block 0 also sees a row of block 3, in another group
    assert packed_attention._groups(mask, 4 * block_size, block_size, block_size) is None
    assert packed_attention._groups(mask.float(), 4 * block_size, block_size, block_size) is None  # additive
    assert packed_attention._groups(None, 4 * block_size, block_size, block_size) is None
    dense, dense_grads = _attention(drafter, "eager", mask, 10**6, monkeypatch)
    grouped, grads = _attention(drafter, "eager", mask, block_size, monkeypatch)
    torch.testing.assert_close(grouped, dense, **CLOSE)
    torch.testing.assert_close(grads[1], dense_grads[1], **CLOSE)


def test_the_training_loss_is_the_same_with_grouped_attention(monkeypatch):
    target = tiny_target(torch.float64)
    drafter = tiny_drafter(target, std=0.3).double()
    drafter.config._attn_implementation = "sdpa"
    input_ids = torch.randint(3, 96, (2, 48), generator=torch.Generator().manual_seed(5))
    loss_mask = torch.arange(48).expand(2, 48) >= 8

    def loss_and_grads(rows_per_group):
        monkeypatch.setattr(packed_attention, "ROWS_PER_GROUP", rows_per_group)
        drafter.zero_grad()
        loss, _ = dflash_loss(drafter, target, input_ids, loss_mask, 9, generator=torch.Generator().manual_seed(1))
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in drafter.parameters()]

    calls = []
    real_groups = packed_attention._groups
    monkeypatch.setattr(packed_attention, "_groups", lambda *a: calls.append(real_groups(*a)) or calls[-1])
    dense_loss, dense_grads = loss_and_grads(10**6)
    loss, grads = loss_and_grads(2 * drafter.config.block_size)
    assert calls[0] is None and len(calls) == 2 * len(drafter.layers) and calls[-1] is not None
    torch.testing.assert_close(loss, dense_loss, **CLOSE)
    for grad, dense_grad in zip(grads, dense_grads):
        torch.testing.assert_close(grad, dense_grad, **CLOSE)
    assert drafter.config._attn_implementation == "sdpa"
