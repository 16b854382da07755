"""The DFlash training loss: one step for a batch (context features, anchors, packed blocks, weighted
cross-entropy)."""

import torch
from torch import nn
from torch.nn import functional as F

from .blocks import (
    block_position_ids,
    build_block_attention_mask,
    follows_target_path,
    loss_weights,
    sample_anchors,
)
from .features import target_features_and_choices
from .packed_attention import grouped_block_attention

LABEL_RULES = ("auto", "target", "text")


def check_label_rule(labels: str) -> None:
    if labels not in LABEL_RULES:
        raise ValueError(f"labels={labels!r}: use one of {LABEL_RULES}.")


def dflash_loss(
    drafter: nn.Module,
    target: nn.Module,
    input_ids: torch.LongTensor,
    loss_mask: torch.BoolTensor,
    num_anchors: int,
    attention_mask: torch.Tensor | None = None,
    context_features: torch.Tensor | None = None,
    gamma: float | None = None,
    generator: torch.Generator | None = None,
    target_ids: torch.LongTensor | None = None,
    labels: str = "auto",
    target_top_ids: torch.Tensor | None = None,
    target_top_logprobs: torch.Tensor | None = None,
    kl_weight: float = 0.0,
    top_k: int = 16,
) -> tuple[torch.Tensor, dict]:
    """The DFlash training loss of a batch: random anchored blocks, one packed drafter forward, weighted cross-entropy.

    drafter: the `DFlashDraftModel` (possibly wrapped by DDP: its forward is what gets called).
    target: the frozen target; its embeddings embed the blocks and its `lm_head` gives the logits. It runs only when
        `context_features` is None.
    input_ids `[b, S]`, loss_mask `[b, S]` (True on response tokens), attention_mask `[b, S]` (None = no padding).
    context_features `[b, S, K * H]`: precomputed `target_context_features` (offline training), else computed here.
    gamma: loss decay over block slots (default `default_gamma(block_size)`).
    generator: random source of the anchors (`torch.Generator` on the batch's device).
    target_ids `[b, S]`: the target's greedy choice at each position (`target_features_and_choices`, cached by
        `dflash features`); computed here for `labels="target"` when the target runs anyway.
    labels: which token slot k of a block learns.
        "target": the target's choice after the block's text so far, as greedy verification would accept it; a
            slot whose text before it has left the target's greedy path is masked (what verification would see
            there is not in the data). With the target's own greedy answers this equals "text".
        "text": the data's own next token.
        "auto" (default): "target" when `target_ids` is given or the target runs here, else "text".
    target_top_ids, target_top_logprobs `[b, S, k]`: the target's k most likely next tokens at each position and
        their log-probabilities (`dflash features --top-k`); computed here (`top_k` of them) when the target runs.
    kl_weight: distillation. The loss is `(1 - kl_weight) * cross-entropy + kl_weight * KL(target || drafter)` on the
        same labelled slots and weights, the target's distribution being its top k renormalised over the draft
        vocabulary. 0 (default) trains on the hard labels alone.

    Returns `(loss, metrics)`; metrics are detached tensors: `loss`, `accuracy` (top-1 over labelled slots),
    `slot_accuracy` `[block_size - 1]` (slots 1 ..), `acceptance_length` (a proxy of tau: 1 + the mean number of
    leading slots of a block that are all right, a slot without label counting as wrong), `num_blocks`, `num_labels`.
    """
    unwrapped = getattr(drafter, "module", drafter)
    config = unwrapped.config
    if config._attn_implementation == "flash_attention_2":
        raise ValueError("FlashAttention-2 cannot apply the packed-block mask; train with 'sdpa' or 'eager' attention.")
    block_size = config.block_size
    batch, seq_len = input_ids.shape
    device = input_ids.device
    dtype = unwrapped.fc.weight.dtype

    check_label_rule(labels)
    if not 0.0 <= kl_weight <= 1.0:
        raise ValueError(f"kl_weight={kl_weight}: use a share between 0 (hard labels only) and 1 (KL only).")
    distill = kl_weight > 0
    if context_features is None:
        context_features, computed_ids, computed_top = target_features_and_choices(
            target,
            input_ids,
            config.target_layer_ids,
            attention_mask,
            choices=labels != "text" and target_ids is None,
            top_k=top_k if distill and target_top_ids is None else 0,
        )
        target_ids = computed_ids if target_ids is None else target_ids
        if computed_top is not None:
            target_top_ids, target_top_logprobs = computed_top
    if distill and (target_top_ids is None or target_top_logprobs is None):
        raise ValueError(
            "kl_weight > 0 needs the target's top tokens per position: the cached features carry none. Cache them "
            "with `dflash features --top-k 16 --out NEW_DIR`, or train with --kl-weight 0."
        )
    if labels == "target" and target_ids is None:
        raise ValueError(
            'labels="target" needs the target\'s choices: the cached features carry none (made by an older '
            "`dflash features`). Recompute them with `dflash features --out NEW_DIR`, or train with --labels text."
        )
    use_target = labels != "text" and target_ids is not None

    # Blocks: [clean anchor token, MASK x (block_size - 1)] at positions anchor .. anchor + block_size - 1.
    anchors, anchor_valid = sample_anchors(loss_mask, num_anchors, block_size, generator)  # [b, n]
    num_blocks = anchors.shape[1]
    block_ids = torch.full((batch, num_blocks, block_size), config.mask_token_id, dtype=torch.long, device=device)
    block_ids[:, :, 0] = input_ids.gather(1, anchors)
    with torch.no_grad():
        block_embeddings = target.get_input_embeddings()(block_ids.flatten(1))

    with grouped_block_attention(unwrapped):  # the same attention, without the keys no block sees
        hidden = drafter(
            block_embeddings=block_embeddings.to(dtype),
            context_features=context_features.to(dtype),
            block_position_ids=block_position_ids(anchors, block_size),
            context_position_ids=torch.arange(seq_len, device=device).expand(batch, seq_len),
            attention_mask=build_block_attention_mask(anchors, seq_len, block_size),
        ).last_hidden_state.view(batch, num_blocks, block_size, -1)

    # Labels: slot k of a block predicts token[anchor + k]; it counts if that token is a response token.
    slots = torch.arange(block_size, device=device)
    label_positions = (anchors[:, :, None] + slots).clamp(max=seq_len - 1).flatten(1)
    text_labels = input_ids.gather(1, label_positions).view(batch, num_blocks, block_size)
    labelled = loss_mask.gather(1, label_positions).view(batch, num_blocks, block_size)
    labelled = labelled & anchor_valid[:, :, None] & (slots > 0)
    if use_target:
        block_labels = target_ids.gather(1, label_positions).view(batch, num_blocks, block_size)
        # A slot counts while the text before it follows the target's greedy path; the first slot that leaves the
        # path still learns the target's choice.
        labelled[:, :, 1:] &= follows_target_path(text_labels[:, :, 1:], block_labels[:, :, 1:])
    else:
        block_labels = text_labels

    # Weighted cross-entropy over the labelled slots only (the LM head is the expensive part: skip the rest). With a
    # reduced draft vocabulary the logits cover only its rows, and a label outside it has no loss (it can never be
    # drafted) but counts as a miss in the metrics.
    head_weight, head_bias = unwrapped.draft_head(target.get_output_embeddings())
    logits = F.linear(hidden[labelled].to(head_weight.dtype), head_weight, head_bias)  # [num_labels, draft vocab]
    logits = logits.float() if logits.element_size() < 4 else logits  # cross-entropy in float32 at least
    targets = block_labels[labelled]
    slot_weights = loss_weights(block_size, gamma).to(device).expand_as(labelled)[labelled]
    weights = slot_weights
    vocab_ids = unwrapped.draft_vocab_ids
    if vocab_ids is None:
        draft_targets = targets
    else:
        target_to_draft = torch.full((config.vocab_size,), -1, dtype=torch.long, device=device)
        target_to_draft[vocab_ids] = torch.arange(len(vocab_ids), device=device)
        draft_targets = target_to_draft[targets]
        weights = weights * (draft_targets >= 0)
    token_losses = F.cross_entropy(logits, draft_targets.clamp(min=0), reduction="none")
    loss = (token_losses * weights).sum() / weights.sum().clamp(min=1e-8)
    kl = None
    if distill:
        # The target's distribution at each labelled slot's position: the same context as its hard label.
        k = target_top_ids.shape[-1]
        index = label_positions[:, :, None].expand(-1, -1, k)
        teacher_ids = target_top_ids.long().gather(1, index).view(batch, num_blocks, block_size, k)[labelled]
        teacher_logprobs = target_top_logprobs.float().gather(1, index).view(batch, num_blocks, block_size, k)
        if vocab_ids is not None:
            teacher_ids = target_to_draft[teacher_ids]  # -1: outside the draft vocabulary
        kl = distillation_loss(
            logits,
            teacher_ids,
            teacher_logprobs[labelled],
            slot_weights,
        )
        loss = (1 - kl_weight) * loss + kl_weight * kl

    with torch.no_grad():
        predictions = logits.argmax(dim=-1)
        correct = (predictions if vocab_ids is None else vocab_ids[predictions]) == targets
        slot_of_label = slots.expand_as(labelled)[labelled]
        slot_counts = torch.bincount(slot_of_label, minlength=block_size)[1:]
        slot_correct = torch.bincount(slot_of_label, weights=correct.float(), minlength=block_size)[1:]
        correct_grid = torch.zeros_like(labelled)
        correct_grid[labelled] = correct
        accepted = correct_grid[:, :, 1:].long().cumprod(dim=-1).sum(dim=-1)  # [b, n], 0 for padding blocks
        num_valid_blocks = anchor_valid.sum()
        metrics = {
            "loss": loss.detach(),
            "accuracy": correct.float().sum() / max(len(correct), 1),
            "slot_accuracy": slot_correct / slot_counts.clamp(min=1),
            "acceptance_length": 1 + accepted.sum() / num_valid_blocks.clamp(min=1),
            "num_blocks": num_valid_blocks,
            "num_labels": labelled.sum(),
            # share of the labels that equal the data's own token (1 with the text rule)
            "text_agreement": (text_labels[labelled] == targets).float().sum() / max(len(targets), 1),
        }
        if kl is not None:
            metrics["kl"] = kl.detach()
    return loss, metrics


def distillation_loss(
    logits: torch.Tensor, teacher_ids: torch.LongTensor, teacher_logprobs: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Weighted mean of KL(teacher || drafter) over labelled slots.

    logits `[n, V]`: the drafter's, over its (draft) vocabulary. teacher_ids `[n, k]`: the target's top k tokens in
    that vocabulary (-1 = outside it, dropped), teacher_logprobs `[n, k]` theirs. The teacher is renormalised over
    the tokens kept; a slot with none kept has no loss.
    """
    kept = teacher_ids >= 0
    teacher = teacher_logprobs.exp() * kept
    mass = teacher.sum(-1, keepdim=True)
    teacher = teacher / mass.clamp(min=1e-12)
    student = logits.log_softmax(-1).gather(1, teacher_ids.clamp(min=0))
    teacher_log = torch.where(teacher > 0, teacher.clamp(min=1e-12).log(), torch.zeros_like(teacher))
    per_slot = (teacher * (teacher_log - student)).sum(-1)
    weights = weights * (mass.squeeze(-1) > 0)
    return (per_slot * weights).sum() / weights.sum().clamp(min=1e-8)
