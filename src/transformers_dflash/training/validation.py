"""Validation during training: the mean acceptance length of real speculative decoding."""

import torch
from torch import nn


@torch.no_grad()
def evaluate_acceptance_length(
    target: nn.Module, drafter: nn.Module, prompts: list[torch.Tensor], max_new_tokens: int = 128
) -> float:
    """Mean acceptance length (tau, bonus token included) of greedy DFlash decoding over `prompts` (1-D id tensors).

    Pools every verification step of every prompt: total tokens gained / number of target forwards (prefill excluded).
    The drafter may keep its own dtype (fp32 master weights next to a bf16 target): decoding casts at its boundary.
    """
    target_param = next(target.parameters())
    was_training = drafter.training
    drafter.eval()
    steps = []
    try:
        for prompt in prompts:
            input_ids = prompt.to(target_param.device)[None]
            target.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                assistant_model=drafter,
                max_new_tokens=max_new_tokens,
                do_sample=False,
            )
            steps.extend(drafter.last_acceptance_lengths[1:])  # entry 0 is the prefill's token
    finally:
        drafter.train(was_training)
    return sum(steps) / len(steps) if steps else float("nan")


@torch.no_grad()
def replay_acceptance(target: nn.Module, drafter: nn.Module, examples, anchors_per_forward: int = 64) -> dict:
    """Held-out acceptance measured on cached features instead of by decoding: greedy DFlash decoding replayed over
    answers the target wrote itself.

    examples: dicts as `dflash features` caches them (`input_ids`, `loss_mask`, `context_features`, `target_ids`),
    e.g. the target's greedy answers to held-out prompts (`dflash regenerate --prompts mtbench` with an exact engine,
    then `dflash features`). One packed drafter forward per example drafts a block at EVERY response position, as
    training does; the replay then walks those blocks as greedy decoding with whole blocks and no copied drafts would:
    from the first response token, accept the leading drafts equal to the target's choices, move to the bonus token.
    On the target's own greedy answers this reproduces `drafter.last_acceptance_lengths` of `generate()` exactly (the
    same prompt and `max_new_tokens`); where the text leaves the target's greedy path, a slot counts only while the text
    before it follows the path (the training label rule), so the figure is then an estimate.

    Returns `tau` (tokens per target forward, bonus included, pooled over examples: what `generate()` reports),
    `tau_all_anchors` (1 + the mean accepted drafts of a block at every response position: lower variance),
    `slot_accuracy` (per draft slot, among labelled slots), `steps`, `anchors` (blocks drafted), and
    `acceptance_lengths`: per example, the tokens each replayed step committed (`drafter.last_acceptance_lengths[1:]`
    of the decoding it replays).
    """
    from ..candidate_generator import DraftHead
    from .blocks import follows_target_path

    was_training = drafter.training
    drafter.eval()
    config = drafter.config
    block_size = config.block_size
    head = DraftHead(drafter, target.get_output_embeddings())
    embed = target.get_input_embeddings()
    slots = torch.arange(block_size)
    committed = steps = num_anchors = accepted_sum = 0
    per_example = []
    slot_correct, slot_total = torch.zeros(block_size - 1), torch.zeros(block_size - 1)
    try:
        for example in examples:
            input_ids, target_ids = example["input_ids"].long(), example["target_ids"].long()
            response = example["loss_mask"].bool().nonzero().flatten()
            seq_len = len(input_ids)
            if len(response) == 0 or int(response[0]) >= seq_len - 1:
                continue  # no draft step: the answer is a single token
            first = int(response[0])
            anchors = torch.arange(first, seq_len - 1)[None]  # every committed token but the last can anchor a block
            # Blocks in chunks: a packed forward attends every block row to every block's keys (masked), so one
            # forward over all anchors would cost the square of their number.
            drafts = torch.cat(
                [
                    _block_drafts(drafter, head, embed, input_ids, example["context_features"], chunk, block_size)
                    for chunk in anchors.split(anchors_per_forward, dim=1)
                ]
            )  # [anchors, block_size - 1]
            # Slot k of the block at a drafts position a + k; it exists while a + k < seq_len and is accepted while it
            # and every slot before it equal the target's choices, and the text before it follows them.
            positions = (anchors[0][:, None] + slots[1:]).clamp(max=seq_len - 1)
            exists = anchors[0][:, None] + slots[1:] < seq_len
            labels = target_ids[positions]
            on_path = follows_target_path(input_ids[positions], labels)  # the training label rule
            correct = (drafts == labels) & exists & on_path
            accepted = correct.long().cumprod(-1).sum(-1)  # [anchors]
            labelled = exists & on_path
            slot_correct += (correct & labelled).sum(0).float()
            slot_total += labelled.sum(0).float()
            num_anchors += len(accepted)
            accepted_sum += int(accepted.sum())
            # The replay: each step commits the accepted drafts + the bonus token, never past the end of the answer.
            position, lengths = first, []
            while position < seq_len - 1:
                lengths.append(min(int(accepted[position - first]) + 1, seq_len - 1 - position))
                position += lengths[-1]
            per_example.append(lengths)
            committed, steps = committed + sum(lengths), steps + len(lengths)
    finally:
        drafter.train(was_training)
    return {
        "tau": committed / steps if steps else float("nan"),
        "tau_all_anchors": 1 + accepted_sum / num_anchors if num_anchors else float("nan"),
        "slot_accuracy": (slot_correct / slot_total.clamp(min=1)).tolist(),
        "steps": steps,
        "anchors": num_anchors,
        "acceptance_lengths": per_example,
    }


def _block_drafts(drafter, head, embed, input_ids, context_features, anchors, block_size) -> torch.LongTensor:
    """The drafter's proposals `[anchors, block_size - 1]` for blocks at `anchors` `[1, n]` of one sequence, in one
    packed forward over its whole context (as training runs it)."""
    from .blocks import block_position_ids, build_block_attention_mask

    param = next(drafter.parameters())
    seq_len = len(input_ids)
    block_ids = torch.full((1, anchors.shape[1], block_size), drafter.config.mask_token_id, dtype=torch.long)
    block_ids[0, :, 0] = input_ids[anchors[0]]
    hidden = drafter(
        block_embeddings=embed(block_ids.flatten(1).to(embed.weight.device)).to(param.device, param.dtype),
        context_features=context_features[None].to(param.device, param.dtype),
        block_position_ids=block_position_ids(anchors, block_size).to(param.device),
        context_position_ids=torch.arange(seq_len, device=param.device)[None],
        attention_mask=build_block_attention_mask(anchors, seq_len, block_size).to(param.device),
    ).last_hidden_state.view(anchors.shape[1], block_size, -1)
    return head(hidden[:, 1:])[0].cpu()
