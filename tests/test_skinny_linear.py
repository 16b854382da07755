"""`skinny_linear` (the CPU verification kernel) and the `skinny_linears` context that DFlash decoding runs in.

The kernel only changes the summation order of float32 products with 1..256 rows, so it must agree with `F.linear`
to rounding, leave every other case to `F.linear` bit for bit, and never change a generated token.
"""

import pytest
import torch
from conftest import ARCHITECTURES, PAD, make_drafter, make_target, random_prompt
from torch import nn
from torch.nn import functional as F

from transformers_dflash.kernels import skinny_linear, skinny_linears

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """torch's thread count for the test (the kernel's choice depends on it), restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("shape", [(24,), (1, 24), (1, 1, 24), (2, 24), (7, 24), (3, 5, 24), (256, 24)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("out_features", [40, 24 * 8])  # a projection, and a tall weight such as an LM head
def test_skinny_linear_agrees_with_linear(shape, with_bias, out_features, threads):
    torch.manual_seed(0)
    x, weight = torch.randn(shape), torch.randn(out_features, 24)
    bias = torch.randn(out_features) if with_bias else None
    out = skinny_linear(x, weight, bias)
    assert out.shape == (*shape[:-1], out_features) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_kernel_choice_follows_the_thread_count(monkeypatch):
    """Several threads: the transposed product for 2..256 rows, and for one row of a tall weight. One thread (where
    MKL's matrix-vector product is the faster one-row kernel and the GEMM's loss is smaller): 2..4 rows, 2..8 for a
    tall weight, never one row. Anything else is `F.linear`, bit for bit."""
    from transformers_dflash import kernels

    products = []
    monkeypatch.setattr(kernels.torch, "mm", lambda *a: products.append(1) or torch.matmul(*a))
    square, tall = torch.randn(24, 24), torch.randn(24 * 8, 24)
    expected = {
        2: {(square, 1): False, (tall, 1): True, (square, 2): True, (square, 256): True, (tall, 257): False},
        1: {(tall, 1): False, (square, 2): True, (square, 4): True, (square, 5): False, (tall, 8): True,
            (tall, 9): False},
    }  # fmt: skip
    before = torch.get_num_threads()
    try:
        for count, cases in expected.items():
            torch.set_num_threads(count)
            for (weight, rows), transposed in cases.items():
                products.clear()
                x = torch.randn(rows, 24)
                out = skinny_linear(x, weight)
                assert bool(products) == transposed, (count, tuple(weight.shape), rows)
                if not transposed:
                    assert torch.equal(out, F.linear(x, weight))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    "x, weight",
    [
        (torch.randn(257, 24), torch.randn(40, 24)),  # a prefill-sized input
        (torch.randn(4, 24, dtype=torch.float64), torch.randn(40, 24, dtype=torch.float64)),  # not float32
        (torch.randn(0, 24), torch.randn(40, 24)),  # empty
    ],
)
def test_other_inputs_take_linear_unchanged(x, weight):
    assert torch.equal(skinny_linear(x, weight), F.linear(x, weight))


def test_skinny_linear_keeps_gradients():
    x, weight = torch.randn(4, 8, requires_grad=True), torch.randn(6, 8, requires_grad=True)
    skinny_linear(x, weight).square().sum().backward()
    expected_x, expected_w = torch.autograd.grad(F.linear(x, weight).square().sum(), (x, weight))
    torch.testing.assert_close(x.grad, expected_x)
    torch.testing.assert_close(weight.grad, expected_w)


class _Subclass(nn.Linear):
    pass


def test_context_patches_plain_linears_only_and_restores_them():
    model = nn.Sequential(nn.Linear(8, 8), _Subclass(8, 8), nn.Linear(8, 8))
    model[2].forward = lambda x: x  # e.g. accelerate's hook: an instance-level forward we must keep
    hooked = model[2].forward
    x = torch.randn(3, 8)
    with skinny_linears(model) as kernels:
        assert kernels.patched == [model[0]]
        assert "forward" not in model[1].__dict__ and model[2].forward is hooked
        torch.testing.assert_close(model[0](x), F.linear(x, model[0].weight, model[0].bias))
    assert "forward" not in model[0].__dict__ and model[2].forward is hooked


def test_context_restores_after_an_error():
    layer = nn.Linear(4, 4)
    with pytest.raises(RuntimeError, match="boom"), skinny_linears(layer):
        assert "forward" in layer.__dict__
        raise RuntimeError("boom")
    assert "forward" not in layer.__dict__


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
@pytest.mark.parametrize("fast", [True, False])
def test_float32_greedy_is_lossless_with_either_kernel(arch, fast, oracle):
    """float32 is where the kernel runs: accepted, partly accepted and rejected blocks all equal plain generate()."""
    target = make_target(arch, dtype=torch.float32, seed=3, eos_token_id=None)
    drafter = make_drafter(target, block_size=5, seed=4)
    drafter.fast_cpu_linears = fast
    prompts = [random_prompt(n, seed=n) for n in (3, 12)]
    kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=PAD)
    expected = [target.generate(p, **kwargs) for p in prompts]
    oracle([e[0] for e in expected])
    for prompt, reference in zip(prompts, expected):
        assert torch.equal(target.generate(prompt, assistant_model=drafter, **kwargs), reference)
    assert max(drafter.last_acceptance_lengths) > 1  # the oracle's drafts were accepted: multi-token verification ran
    assert not any("forward" in m.__dict__ for m in target.modules())  # the kernels were handed back


def test_decoding_uses_the_kernel_only_when_enabled(monkeypatch):
    import transformers_dflash.kernels as generation

    calls = []
    original = generation.skinny_linear
    monkeypatch.setattr(generation, "skinny_linear", lambda *a: calls.append(1) or original(*a))
    target = make_target("llama", dtype=torch.float32, eos_token_id=None)
    drafter = make_drafter(target, block_size=4)
    prompt = random_prompt(6, seed=0)
    drafter.fast_cpu_linears = False
    target.generate(prompt, assistant_model=drafter, max_new_tokens=6, do_sample=False)
    assert not calls
    drafter.fast_cpu_linears = True
    target.generate(prompt, assistant_model=drafter, max_new_tokens=6, do_sample=False)
    assert calls


# `packed_gqa_sdpa`: the attention kernel DFlash decoding runs in on CPUs (with the linear kernels).


class _GroupedAttention(nn.Module):
    num_key_value_groups = 3


@pytest.mark.parametrize("num_queries", [1, 2, 5])
@pytest.mark.parametrize("mask_batch", [1, 2])
def test_packed_gqa_attention_agrees_with_sdpa(num_queries, mask_batch):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from transformers_dflash.kernels import packed_gqa_sdpa

    torch.manual_seed(0)
    module = _GroupedAttention().eval()
    query = torch.randn(2, 6, num_queries, 8)
    key, value = torch.randn(2, 2, 11, 8), torch.randn(2, 2, 11, 8)
    mask = torch.rand(mask_batch, 1, num_queries, 11) > 0.3
    mask[..., -1] = True  # every query sees at least one key
    for attention_mask in (mask, torch.where(mask, 0.0, torch.finfo(torch.float32).min), None):
        got, _ = packed_gqa_sdpa(module, query, key, value, attention_mask, scaling=0.3)
        expected, _ = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=0.3)
        assert got.shape == expected.shape == (2, num_queries, 6, 8)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    longer = torch.cat([mask, torch.zeros(mask_batch, 1, num_queries, 3, dtype=torch.bool)], dim=-1)
    got, _ = packed_gqa_sdpa(module, query, key, value, longer, scaling=0.3)  # a mask sized for a longer cache
    torch.testing.assert_close(got, sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)[0])


def test_packed_gqa_context_switches_attention_modules_only_and_restores_them(monkeypatch):
    import transformers_dflash.kernels as generation
    from transformers_dflash.kernels import packed_gqa_attention

    calls = []
    original = generation.packed_gqa_sdpa
    monkeypatch.setattr(generation, "packed_gqa_sdpa", lambda *a, **k: calls.append(a[1].shape) or original(*a, **k))
    target = make_target("qwen3", dtype=torch.float32, eos_token_id=None)
    eager = make_target("llama", attn="eager", dtype=torch.float32, eos_token_id=None)
    ids = torch.randint(3, 90, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        expected = target(input_ids=ids, attention_mask=mask).logits
        with packed_gqa_attention(target, eager) as context:
            assert target.config._attn_implementation == "sdpa"  # the model (and its mask creation) still say sdpa
            attention = [m for m in target.modules() if hasattr(m, "num_key_value_groups")]
            assert len(context.patched) == len(attention) == 4
            assert all(m.config._attn_implementation == generation._PACKED_GQA_SDPA for m in attention)
            got = target(input_ids=ids, attention_mask=mask).logits
        assert len(calls) == 4  # one per layer
        assert all(m.config is target.config for m in attention)
        assert all(m.config._attn_implementation == "eager" for m in eager.modules() if hasattr(m, "config"))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_decoding_uses_packed_attention_with_the_kernels_only(monkeypatch):
    import transformers_dflash.kernels as generation

    calls = []
    original = generation.packed_gqa_sdpa
    monkeypatch.setattr(generation, "packed_gqa_sdpa", lambda *a, **k: calls.append(1) or original(*a, **k))
    target = make_target("llama", dtype=torch.float32, eos_token_id=None)
    drafter = make_drafter(target, block_size=4)
    prompt = random_prompt(6, seed=0)
    for fast in (False, True):
        drafter.fast_cpu_linears = fast
        expected = target.generate(prompt, max_new_tokens=8, do_sample=False)
        assert torch.equal(
            target.generate(prompt, assistant_model=drafter, max_new_tokens=8, do_sample=False), expected
        )
        assert bool(calls) == fast
    assert all(m.config is target.config for m in target.modules() if hasattr(m, "num_key_value_groups"))
