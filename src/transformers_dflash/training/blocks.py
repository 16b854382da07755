"""Anchors, block positions, the packed-block attention mask and the loss weights of one training step."""

import torch


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, block_size: int, generator: torch.Generator | None = None
) -> tuple[torch.LongTensor, torch.BoolTensor]:
    """Random anchor positions among the response positions, without replacement, sorted.

    loss_mask: `[seq_len]` or `[batch, seq_len]` bool, True on response tokens. Candidates are the positions p with
        loss_mask[p] True and p <= seq_len - block_size (the whole block fits in the sequence).
    generator: optional `torch.Generator` on `loss_mask`'s device, for reproducible draws.

    Returns `(anchors, valid)`, both shaped like loss_mask with the last axis replaced by `num_blocks` =
    min(num_anchors, most candidates of any row), at least 1. A row with fewer candidates gets all of them, then
    padding entries: anchor 0 with valid False (they must be ignored by the loss).
    """
    squeeze = loss_mask.dim() == 1
    loss_mask = loss_mask.bool()[None] if squeeze else loss_mask.bool()
    batch, seq_len = loss_mask.shape
    positions = torch.arange(seq_len, device=loss_mask.device)
    candidates = loss_mask & (positions <= seq_len - block_size)
    num_blocks = max(1, min(num_anchors, int(candidates.sum(dim=1).max())))
    # Uniform sampling without replacement: the candidates with the `num_blocks` largest random scores.
    scores = torch.rand(batch, seq_len, device=loss_mask.device, generator=generator)
    scores = scores.masked_fill(~candidates, -1.0)
    chosen = scores.topk(num_blocks, dim=1).indices
    valid = candidates.gather(1, chosen)
    # Sort the valid anchors, padding last.
    anchors = chosen.masked_fill(~valid, seq_len).sort(dim=1).values
    valid = anchors < seq_len
    anchors = anchors.masked_fill(~valid, 0)
    if squeeze:
        return anchors[0], valid[0]
    return anchors, valid


def block_position_ids(anchors: torch.LongTensor, block_size: int) -> torch.LongTensor:
    """Positions of the packed blocks `[batch, num_blocks * block_size]`: anchor .. anchor + block_size - 1 each."""
    offsets = torch.arange(block_size, device=anchors.device)
    return (anchors[:, :, None] + offsets).flatten(1)


def build_block_attention_mask(anchors: torch.LongTensor, seq_len: int, block_size: int) -> torch.BoolTensor:
    """The attention mask of packed blocks, `[batch, 1, num_blocks * block_size, seq_len + num_blocks * block_size]`.

    Keys are [seq_len context rows ; packed block rows] (the drafter's layout); True = may attend. A row of block j sees
    the context positions STRICTLY before anchor j (the anchor itself enters as the block's clean first token) and
    every row of block j, in both directions; it never sees another block.
    """
    batch, num_blocks = anchors.shape
    block_len = num_blocks * block_size
    row_anchor = anchors.repeat_interleave(block_size, dim=1)  # [batch, block_len]
    context_positions = torch.arange(seq_len, device=anchors.device)
    sees_context = context_positions[None, None, :] < row_anchor[:, :, None]  # [batch, block_len, seq_len]
    row_block = torch.arange(block_len, device=anchors.device) // block_size
    sees_block = (row_block[:, None] == row_block[None, :]).expand(batch, block_len, block_len)
    return torch.cat([sees_context, sees_block], dim=2)[:, None]


def follows_target_path(text: torch.LongTensor, choices: torch.LongTensor) -> torch.BoolTensor:
    """Which draft slots have a verifiable context in the data: `text` and `choices` `[..., n]` are the data's tokens
    and the target's greedy choices at draft slots 1..n of blocks. Slot k is verified after the drafts of slots
    1..k-1, so the data shows what verification would see there only while every text token before it (after the
    anchor) equals the target's choice; the first slot always counts."""
    on_path = torch.ones_like(text, dtype=torch.bool)
    on_path[..., 1:] = (text == choices)[..., :-1].long().cumprod(-1).bool()
    return on_path


def default_gamma(block_size: int) -> float:
    """The loss decay of the paper: 4 for block size 8, 5 for 10, 7 for 16.

    Other sizes interpolate linearly between those points and continue the end slopes: block_size / 2 up to 10, then
    5 + (block_size - 10) / 3 (e.g. 2 for 4, 6 for 13, 12.33 for 32).
    """
    if block_size <= 10:
        return block_size / 2
    return 5 + (block_size - 10) / 3


def loss_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """Per-slot weights `[block_size]`: 0 for slot 0 (the anchor), exp(-(k - 1) / gamma) for slot k >= 1."""
    gamma = default_gamma(block_size) if gamma is None else gamma
    slots = torch.arange(block_size, dtype=torch.float32)
    weights = torch.exp(-(slots - 1) / gamma)
    weights[0] = 0.0
    return weights
