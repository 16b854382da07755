"""GPU paths: SDPA and FlashAttention-2 on CUDA, bf16. Skipped cleanly where there is no GPU or no flash_attn."""

import importlib.util

import pytest
import torch
from conftest import make_drafter, make_target, random_prompt

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize(
    "attn",
    [
        "sdpa",
        pytest.param(
            "flash_attention_2",
            marks=pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash_attn not installed"),
        ),
    ],
)
def test_greedy_equality_on_gpu(attn):
    # float32 where the kernel allows it: bfloat16 rounds a 1-token decode and a block verification differently.
    dtype = torch.bfloat16 if attn == "flash_attention_2" else torch.float32
    target = make_target("qwen3", attn=attn, dtype=dtype, eos_token_id=None).cuda()
    drafter = make_drafter(target, block_size=8)
    drafter.config._attn_implementation = attn
    for seed in range(3):
        prompt = random_prompt(11 + seed, seed=seed).cuda()
        expected = target.generate(prompt, max_new_tokens=40, do_sample=False)
        out = target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=drafter)
        assert torch.equal(out, expected)
