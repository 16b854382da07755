"""Prefill of a left-padded batch in groups of similar prompt length (part of the carried core).

On CPUs a forward costs in proportion to its tokens, padding included, so a batch of prompts of very different
lengths wastes most of a padded prefill; the groups prefill it with little padding and lay the result out as one
left-padded batch, so decoding proceeds as after a padded prefill. Measurements: docs/benchmarks.md ("Batched").
"""

import torch
from torch import nn
from torch.nn import functional as F

from .state_rollback import has_recurrent_state
from .target_model import has_sliding_window


def prefill_groups(mask: torch.Tensor, target: nn.Module) -> list[list[int]] | None:
    """Rows of a left-padded batch to prefill together, each group cut to its own longest prompt; None: prefill the
    padded batch in one forward (see `grouped_prefill`).

    A forward of few tokens uses a CPU less well than a long one (prefilling prompts one by one was measured slower
    than their padded batch), so rows are grouped by length, longest first, while a group's slots stay within 1.25x
    its tokens, and the groups are used only if they save a fifth of the slots. Accelerators run the padded batch in
    parallel, and sliding-window layers measure their window in cache slots, so both keep the padded prefill. So do
    hybrid targets: their recurrent state has no slots to lay out (left padding enters it as zero inputs instead).
    """
    if mask.device.type != "cpu" or mask.shape[0] == 1 or has_sliding_window(target) or has_recurrent_state(target):
        return None
    lengths = mask.sum(-1).tolist()
    groups: list[list[int]] = []
    for row in sorted(range(len(lengths)), key=lambda r: -lengths[r]):
        group = groups[-1] if groups else None
        if group and (len(group) + 1) * lengths[group[0]] <= 1.25 * (sum(lengths[r] for r in group) + lengths[row]):
            group.append(row)
        else:
            groups.append([row])
    slots = sum(len(group) * lengths[group[0]] for group in groups)
    return groups if slots <= 0.8 * mask.numel() else None  # a forward more must save a fifth of the slots


def grouped_prefill(target_forward, generator, input_ids, mask, groups, cache):
    """Prefill each group of rows (`prefill_groups`) in its own forward, cut to its longest prompt, then lay the
    groups' caches and features out as one left-padded batch. `target_forward(ids, position_ids, mask, keep, into)`
    runs the target into the cache `into` and returns its logits.

    Gives the same cache layout as a padded prefill of the whole batch (padding slots stay masked; those beyond a
    group's width hold zeros). Returns the last position's logits `[batch, 1, vocab]` and the drafter's context
    features `[batch, prompt_len, K * hidden]`, rows in their original order.
    """
    from transformers.cache_utils import DynamicCache

    prompt_len = input_ids.shape[1]
    logits, features, group_caches = [], [], []
    for rows in groups:
        index = torch.tensor(rows, device=input_ids.device)
        width = int(mask[index].sum(-1).max())
        group_mask = mask[index, prompt_len - width :]
        group_cache = DynamicCache()
        position_ids = (group_mask.cumsum(-1) - 1).clamp(min=0)
        group_attention = None if bool(group_mask.all()) else group_mask
        ids = input_ids[index, prompt_len - width :]
        logits.append(target_forward(ids, position_ids, group_attention, 1, group_cache)[:, -1:])
        features.append(generator.captured_features())
        group_caches.append(group_cache)
    order = torch.tensor([r for rows in groups for r in rows], device=input_ids.device).argsort()

    def left_pad(tensors):  # [rows, ..., width, d] -> zeros before each group's slots up to prompt_len; batch order
        padded = [F.pad(t, (0, 0, prompt_len - t.shape[-2], 0)) for t in tensors]
        return torch.cat(padded)[order]

    for layer_idx in range(len(group_caches[0].layers)):
        keys = left_pad([c.layers[layer_idx].keys for c in group_caches])
        values = left_pad([c.layers[layer_idx].values for c in group_caches])
        cache.update(keys, values, layer_idx)
    return torch.cat(logits)[order], left_pad(features)
