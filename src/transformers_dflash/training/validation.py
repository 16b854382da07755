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
