"""`skinny_linear` (the CPU verification kernel) and the `skinny_linears` context that DFlash decoding runs in.

The kernel only changes the summation order of float32 products with 1..256 rows, so it must agree with `F.linear`
to rounding, leave every other case to `F.linear` bit for bit, and never change a generated token.
"""

import pytest
import torch
from conftest import ARCHITECTURES, PAD, make_drafter, make_target, random_prompt
from torch import nn
from torch.nn import functional as F

from transformers_dflash.generation_dflash import skinny_linear, skinny_linears

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("shape", [(24,), (1, 24), (1, 1, 24), (2, 24), (7, 24), (3, 5, 24), (256, 24)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_linear_agrees_with_linear(shape, with_bias):
    torch.manual_seed(0)
    x, weight = torch.randn(shape), torch.randn(40, 24)
    bias = torch.randn(40) if with_bias else None
    out = skinny_linear(x, weight, bias)
    assert out.shape == (*shape[:-1], 40) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


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
    import transformers_dflash.generation_dflash as generation

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
