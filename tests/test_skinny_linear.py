"""`skinny_linear` (the CPU verification kernel) and the `skinny_linears` context that DFlash decoding runs in.

The kernel only changes the summation order of float32 products with 1..256 rows, so it must agree with `F.linear`
to rounding, leave every other case to `F.linear` bit for bit, and never change a generated token.
"""

import itertools
import types

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


@pytest.fixture
def kernel_choices(monkeypatch):
    """The kernels module with an empty table of measured choices (restored afterwards)."""
    from transformers_dflash import kernels

    monkeypatch.setattr(kernels, "_kernel_choice", {})
    return kernels


def test_kernel_choice_is_measured_once_per_shape_row_count_and_threads(monkeypatch, kernel_choices):
    """The first input of each (weight shape, row count, thread count) is timed with each kernel; the fastest one is
    used from then on. Row counts above 8 share a power-of-two bucket; past 256 rows nothing is measured. Where
    `F.linear` is chosen, the output is `F.linear`'s bit for bit."""
    kernels = kernel_choices
    measured, products = [], []
    # Stand-in measurement: the transposed product "wins" for even row counts.
    monkeypatch.setattr(
        kernels,
        "_measure",
        lambda flat, weight, cold=None: (
            measured.append(flat.shape[0]) or ("linear", "transposed")[flat.shape[0] % 2 == 0]
        ),
    )
    monkeypatch.setattr(kernels.torch, "mm", lambda *a: products.append(1) or torch.matmul(*a))
    weight = torch.randn(40, 24)
    before = torch.get_num_threads()
    try:
        for threads, rows, measures, transposed in [
            (2, 2, True, True),
            (2, 2, False, True),  # measured once
            (2, 3, True, False),
            (2, 9, True, False),  # bucket 16, measured with the 9 rows that came first
            (2, 16, False, False),  # same bucket: no new measurement, the bucket's choice
            (2, 257, False, False),  # a prefill-sized input: F.linear, never measured
            (1, 2, True, True),  # another thread count: measured again
        ]:
            torch.set_num_threads(threads)
            measured.clear(), products.clear()
            x = torch.randn(rows, 24)
            out = skinny_linear(x, weight)
            assert (bool(measured), bool(products)) == (measures, transposed), (threads, rows)
            if not transposed:
                assert torch.equal(out, F.linear(x, weight))
            else:
                torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)
    measured.clear()
    assert skinny_linear(torch.randn(4, 24), torch.randn(12, 24)).shape == (4, 12)  # another shape: its own entry
    assert measured == [4]


@pytest.mark.parametrize(
    "microseconds, chosen",
    [
        ({"linear": 100, "transposed": 85}, "transposed"),
        ({"linear": 100, "transposed": 95}, "linear"),  # within the margin: F.linear, bit for bit plain decoding's
        ({"linear": 40, "transposed": 32}, "linear"),  # 20 % faster, but saves less than the detour costs
        ({"linear": 100, "transposed": 85, "packed": 70}, "transposed"),  # the packed copy must save more
        ({"linear": 10000, "transposed": 8000, "packed": 5000}, "packed"),
        ({"linear": 10000, "transposed": 12000, "packed": 7000}, "packed"),
        ({"linear": 10000, "transposed": 12000, "packed": 8000}, "linear"),  # 20 % faster: not worth a copy
        ({"linear": 10000, "transposed": 6000, "packed": 5000}, "transposed"),
        ({"linear": 10000, "transposed": 12000, "packed": 9500}, "linear"),
    ],
)
def test_choice_needs_a_margin_and_a_saving_larger_than_the_detour(microseconds, chosen):
    from transformers_dflash import kernels

    assert kernels._choose({name: value * 1e-6 for name, value in microseconds.items()}) == chosen


def test_measuring_is_left_out_of_the_step_clock(monkeypatch, kernel_choices):
    """The decoding loop times its steps with `step_clock`, which stands still while a kernel choice is measured (a
    fake clock that ticks once per reading: across a measurement the step clock moves by its own two readings)."""
    kernels = kernel_choices
    ticks = iter(range(1000))
    monkeypatch.setattr(kernels, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    monkeypatch.setattr(kernels, "_measuring_seconds", 0.0)
    before = kernels.step_clock()
    assert kernels._measure(torch.randn(3, 24), torch.randn(40, 24)) in ("linear", "transposed", "packed")
    assert next(ticks) - 1 - before > 10  # the measurement read the clock many times ...
    assert kernels.step_clock() - before == 3.0  # ... but the step clock moved by its own readings only


def test_packing_is_left_out_of_the_step_clock(monkeypatch, packing):
    """Packing a weight (on its first packed product) stands the step clock still too: counted in the step, it made
    the first step of a packed width look several times dearer than the width is, and "auto" never chose it again."""
    ticks = iter(range(1000))
    monkeypatch.setattr(packing, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    monkeypatch.setattr(packing, "_pack", lambda weight: (next(ticks), next(ticks), weight.clone())[-1])  # 2 ticks
    monkeypatch.setattr(packing, "_measuring_seconds", 0.0)
    weight = torch.randn(40, 24)
    before = packing.step_clock()
    packing.packed_weight(weight)  # packs: the packing's 2 ticks between 2 readings of its own
    assert packing.step_clock() - before == 2.0  # 5 ticks passed, the 3 from packing's start to its end left out ...
    before = packing.step_clock()
    packing.packed_weight(weight)  # ... and a packed weight is not packed (or left out) again
    assert packing.step_clock() - before == 1.0


def test_each_measured_run_reads_a_weight_out_of_cache(monkeypatch, kernel_choices):
    """A forward reads each weight from memory (the rest of the model has passed through the caches since), so the
    choice is measured on copies that together are twice the last-level cache, each read once per lap; a weight
    that large itself is measured as it is. Every run of `_measure` takes the next copy, packed for the packed
    product."""
    kernels = kernel_choices
    monkeypatch.setattr(kernels, "_last_level_cache_bytes", lambda: 4096)  # bytes: 2 x 4096 = 8 weights of 1 KiB
    weight = torch.randn(16, 16)  # 1 KiB of float32
    cold = kernels.ColdCopies(weight)
    copies = list(itertools.islice(cold.cycle(), 16))
    assert copies[0] is weight and all(torch.equal(c, weight) for c in copies)
    assert len({c.data_ptr() for c in copies}) == 8 and copies[8] is weight  # 8 distinct, then again from the first
    assert cold.copies is cold.copies  # made once, for all the row counts measured on them
    large = torch.randn(64, 64)  # 16 KiB, more than twice the cache
    assert all(c is large for c in itertools.islice(kernels.ColdCopies(large).cycle(), 3))
    monkeypatch.setattr(kernels, "_last_level_cache_bytes", lambda: 2**40)  # a cache far larger than the model:
    monkeypatch.setattr(kernels, "_MAX_COLD_BYTES", 4096)  # the copies stay bounded
    assert len(kernels.ColdCopies(weight).copies) == 4
    monkeypatch.setattr(kernels, "_MAX_COLD_COPIES", 3)  # and so does their count, for a weight of a few KiB
    assert len(kernels.ColdCopies(weight).copies) == 3
    monkeypatch.setattr(kernels, "_last_level_cache_bytes", lambda: 4096)

    class Recorded(kernels.ColdCopies):
        def cycle(self, packed=False):
            kernel = len(cycles)
            cycles.append(packed)
            return (read.append((kernel, index)) or c for index, c in enumerate(super().cycle(packed)))

    cycles, read = [], []
    kernels._measure(torch.randn(2, 16), weight, cold=Recorded(weight))
    assert cycles == [False, False, True] if kernels.packing_available() else [False, False]  # the packed: packed
    runs = kernels._MEASURE_REPEATS + 1
    assert len(read) == len(cycles) * runs  # one copy per run, each kernel from its own cycle, the next copy each time
    assert all([index for kernel, index in read if kernel == k] == list(range(runs)) for k in range(len(cycles)))


@pytest.fixture
def packing(kernel_choices):
    if not kernel_choices.packing_available():
        pytest.skip("this torch has no oneDNN packed linear")
    return kernel_choices


@pytest.mark.parametrize("shape", [(24,), (1, 24), (3, 5, 24), (9, 24), (256, 24)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_agrees_with_linear(shape, with_bias, packing, threads):
    torch.manual_seed(0)
    x, weight = torch.randn(shape), torch.randn(40, 24)
    bias = torch.randn(40) if with_bias else None
    out = packing.packed_linear(x, weight, bias)
    assert out.shape == (*shape[:-1], 40)
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_packed_copy_follows_its_weight(packing):
    """The packed copy is made once, made again after an in-place change of the weight (a training step, a
    `load_state_dict`), and dropped when the weight is freed."""
    import gc

    weight, x = torch.randn(40, 24), torch.randn(3, 24)
    first = packing.packed_weight(weight)
    assert packing.packed_weight(weight) is first
    with torch.no_grad():
        weight.mul_(2)
    assert packing.packed_weight(weight) is not first
    torch.testing.assert_close(packing.packed_linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    key = id(weight)
    assert key in packing._packed_weights
    del weight
    gc.collect()
    assert key not in packing._packed_weights


def test_packed_copy_of_a_weight_made_in_inference_mode(packing):
    """A weight made under `torch.inference_mode()` has no version counter (the drafter slices its draft head from the
    LM head inside generate(), which a user may call in inference mode): its copy is made once and used."""
    with torch.inference_mode():
        weight, x = torch.randn(40, 24), torch.randn(3, 24)
        first = packing.packed_weight(weight)
        assert packing.packed_weight(weight) is first
        torch.testing.assert_close(packing.packed_linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert packing.packed_weight(weight) is first


def test_packed_choice_keeps_gradients(monkeypatch, packing):
    """Where autograd must differentiate the product, a packed choice computes `F.linear` instead (the packed
    operator has no backward)."""
    monkeypatch.setattr(packing, "_measure", lambda flat, weight, cold=None: "packed")
    x, weight = torch.randn(4, 8, requires_grad=True), torch.randn(6, 8, requires_grad=True)
    skinny_linear(x, weight).square().sum().backward()
    expected_x, expected_w = torch.autograd.grad(F.linear(x, weight).square().sum(), (x, weight))
    torch.testing.assert_close(x.grad, expected_x)
    torch.testing.assert_close(weight.grad, expected_w)
    with torch.no_grad():
        torch.testing.assert_close(skinny_linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_without_packing_two_products_are_measured(monkeypatch, kernel_choices):
    """A torch whose oneDNN operators are missing or fail is measured with `F.linear` and the transposed product
    only, never chooses the packed one."""
    kernels = kernel_choices

    def missing(weight):
        raise RuntimeError("no mkldnn here")

    monkeypatch.setattr(kernels, "_pack", missing)
    kernels.packing_available.cache_clear()
    try:
        assert not kernels.packing_available()
        for rows in (1, 4, 8):
            assert kernels._measure(torch.randn(rows, 64), torch.randn(512, 64)) in ("linear", "transposed")
    finally:
        kernels.packing_available.cache_clear()


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


def test_context_with_rows_patches_only_the_layers_faster_another_way_for_one_of_them(monkeypatch, kernel_choices):
    """Given the row counts to expect, the context measures each (weight shape, row count) on entry, once, and leaves
    the layers whose shape is faster with F.linear for all of them as they are (no per-call detour)."""
    measured = []

    def measure(flat, weight, cold=None):
        measured.append((tuple(weight.shape), flat.shape[0]))
        return "transposed" if weight.shape[0] == 40 and flat.shape[0] == 4 else "linear"  # only (40 x 24, 4 rows)

    monkeypatch.setattr(kernel_choices, "_measure", measure)
    model = nn.Sequential(nn.Linear(24, 40), nn.Linear(40, 24), nn.Linear(24, 40))
    with skinny_linears(model, rows=[1, 4, 2, 2]) as kernels:
        assert kernels.patched == [model[0], model[2]]
    assert sorted(measured) == [
        ((24, 40), 1),
        ((24, 40), 2),
        ((24, 40), 4),
        ((40, 24), 1),
        ((40, 24), 2),
        ((40, 24), 4),
    ]
    assert not any("forward" in m.__dict__ for m in model)


def test_context_restores_after_an_error():
    layer = nn.Linear(4, 4)
    with pytest.raises(RuntimeError, match="boom"), skinny_linears(layer):
        assert "forward" in layer.__dict__
        raise RuntimeError("boom")
    assert "forward" not in layer.__dict__


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
@pytest.mark.parametrize("kernel", ["transposed", "packed", "measured", "stock"])
def test_float32_greedy_is_lossless_with_each_kernel(arch, kernel, oracle, monkeypatch, kernel_choices):
    """float32 is where the kernel runs: accepted, partly accepted and rejected blocks all equal plain generate(),
    with the transposed or the packed product wherever it applies, with this machine's measured choice, and with
    F.linear."""
    if kernel == "packed" and not kernel_choices.packing_available():
        pytest.skip("this torch has no oneDNN packed linear")
    if kernel in ("transposed", "packed"):
        monkeypatch.setattr(kernel_choices, "_measure", lambda flat, weight, cold=None: kernel)
    target = make_target(arch, dtype=torch.float32, seed=3, eos_token_id=None)
    drafter = make_drafter(target, block_size=5, seed=4)
    drafter.fast_cpu_linears = kernel != "stock"
    prompts = [random_prompt(n, seed=n) for n in (3, 12)]
    kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=PAD)
    expected = [target.generate(p, **kwargs) for p in prompts]
    oracle([e[0] for e in expected])
    for prompt, reference in zip(prompts, expected):
        assert torch.equal(target.generate(prompt, assistant_model=drafter, **kwargs), reference)
    assert max(drafter.last_acceptance_lengths) > 1  # the oracle's drafts were accepted: multi-token verification ran
    assert not any("forward" in m.__dict__ for m in target.modules())  # the kernels were handed back


def test_decoding_uses_the_kernel_only_when_enabled(monkeypatch, kernel_choices):
    import transformers_dflash.kernels as generation

    monkeypatch.setattr(kernel_choices, "_measure", lambda flat, weight, cold=None: "transposed")  # wherever it can

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
