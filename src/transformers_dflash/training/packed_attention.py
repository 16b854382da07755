"""Attention over packed blocks without the keys no block sees: the training forward's attention, by groups of blocks.

The training forward packs all blocks of a sequence after its context rows, and the block attention mask
(`blocks.build_block_attention_mask`) lets a block see only the context before its anchor and its own rows. A dense
masked attention still multiplies every block row with every key, most of which it does not see. Anchors are sorted,
so consecutive blocks see similar context prefixes: split the rows into groups of whole blocks, and let each group
attend only to the context up to the last key any of its rows sees and to its own blocks' rows. The result is the
dense one's (the keys left out are masked for every row of the group; `_groups` checks that on the mask itself and
falls back to the dense call when it does not hold), for less work (docs/training.md, "Grouped attention in
training").

Registered with transformers' `AttentionInterface` and switched on around the training forward by
`grouped_block_attention`, so the drafter's modeling code (which checkpoints carry) stays as it is.
"""

import contextlib

import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..modeling_dflash import eager_attention_forward

# Query rows per group, in whole blocks: smaller groups skip more keys but make more, smaller attention calls. 128 and
# 256 were the fastest of 32-256 at the CPU recipe's shapes (docs/training.md).
ROWS_PER_GROUP = 128


def _groups(mask: torch.Tensor | None, num_rows: int, block_size: int, rows_per_group: int):
    """[(first row, end row, context keys kept)] for groups of whole blocks, or None when grouping cannot be exact (or
    gains nothing): no boolean mask, rows that are not whole blocks, or a row that sees a block row of another group."""
    if mask is None or mask.dtype != torch.bool or mask.dim() != 4 or num_rows % block_size:
        return None
    group_rows = max(block_size, rows_per_group // block_size * block_size)
    if num_rows <= group_rows:
        return None
    num_context = mask.shape[-1] - num_rows
    starts = list(range(0, num_rows, group_rows))
    group_of_row = torch.arange(num_rows, device=mask.device) // group_rows
    seen = mask.flatten(0, 1).any(dim=0)  # [rows, keys]: seen by the row in any sequence of the batch, any head
    # The context each group needs: up to the last context key any of its rows sees.
    last_seen = (seen[:, :num_context] * torch.arange(1, num_context + 1, device=mask.device)).amax(dim=-1)
    context_end = last_seen.new_zeros(len(starts)).scatter_reduce(0, group_of_row, last_seen, reduce="amax")
    leaks = (seen[:, num_context:] & (group_of_row[:, None] != group_of_row[None, :])).any()
    values = torch.cat([context_end, leaks[None].to(context_end.dtype)]).tolist()  # one host sync per layer call
    if values[-1]:
        return None
    return [(start, min(start + group_rows, num_rows), end) for start, end in zip(starts, values[:-1])]


def grouped_attention(base):
    """An attention function that runs `base` (transformers' signature) on each group of `_groups`, or once on
    everything where grouping would not be exact."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        num_rows = query.shape[2]
        groups = _groups(attention_mask, num_rows, module.config.block_size, ROWS_PER_GROUP)
        if groups is None:
            return base(module, query, key, value, attention_mask, **kwargs)
        num_context = key.shape[2] - num_rows
        outputs = []
        for start, end, context_end in groups:
            own = slice(num_context + start, num_context + end)
            group_key = torch.cat([key[:, :, :context_end], key[:, :, own]], dim=2)
            group_value = torch.cat([value[:, :, :context_end], value[:, :, own]], dim=2)
            rows = attention_mask[:, :, start:end]
            group_mask = torch.cat([rows[..., :context_end], rows[..., own]], dim=-1)
            output, _ = base(module, query[:, :, start:end], group_key, group_value, group_mask, **kwargs)
            outputs.append(output)  # [batch, group rows, heads, head_dim]
        return torch.cat(outputs, dim=1), None

    return attention


def _registered_name(implementation: str | None) -> str:
    """The registered grouped version of `implementation` ("eager" or one of transformers' attention functions)."""
    implementation = implementation or "eager"
    name = f"dflash_grouped_{implementation}"
    if name not in ALL_ATTENTION_FUNCTIONS:
        base = eager_attention_forward if implementation == "eager" else ALL_ATTENTION_FUNCTIONS[implementation]
        AttentionInterface.register(name, grouped_attention(base))
    return name


@contextlib.contextmanager
def grouped_block_attention(drafter):
    """Within the block: `drafter`'s attention runs by groups of blocks (`grouped_attention`), then it is restored.
    On CPUs only, where it was measured faster; elsewhere (GPUs, where it would add host syncs and smaller kernels, not
    measured) the attention stays dense."""
    config = drafter.config
    implementation = config._attn_implementation
    if next(drafter.parameters()).device.type != "cpu":
        yield
        return
    config._attn_implementation = _registered_name(implementation)
    try:
        yield
    finally:
        config._attn_implementation = implementation
