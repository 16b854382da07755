"""The target-family matrix: for each decoder family, on a tiny random model, DFlash decoding returns exactly what
plain `generate()` returns, with an untrained drafter (nearly every draft rejected), with the oracle (long, partial
and no accepts), and for a left-padded batch (rows equal to plain batched `generate()`).

A family a transformers version does not have is skipped with the reason; one whose state DFlash cannot roll back
there is refused with a clear error (`test_unsupported_rows_are_refused`), and its decoding tests skip with that
error as the reason. Hybrid families are also checked statistically for sampling in tests/test_hybrid.py.
"""

import pytest
import torch
from conftest import PAD, VOCAB, make_drafter
from families import FAMILIES, MAJOR, available, left_pad, make_family_target

from transformers_dflash.state_rollback import check_state_rollback

pytestmark = pytest.mark.usefixtures("one_thread")


def _supported(name):
    """The target, or a skip: not in this transformers version, or refused (the refusal is tested below)."""
    if not available(name):
        pytest.skip(f"{FAMILIES[name][0]} exists in transformers >= 5 only (installed: {MAJOR}.x)")
    target = make_family_target(name)
    try:
        check_state_rollback(target)
    except ValueError as error:
        pytest.skip(f"refused on transformers {MAJOR}.x: {error}")
    return target


def _drafter(target, block_size=4, seed=1):
    drafter = make_drafter(target, block_size=block_size, seed=seed)
    drafter.draft_length, drafter.ngram_lookup = "full", 0  # verify whole blocks: every step exercises rejection
    return drafter


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_with_an_untrained_drafter(name):
    target = _supported(name)
    drafter = _drafter(target)
    prompt = torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(0))
    kwargs = dict(max_new_tokens=21, do_sample=False, pad_token_id=PAD)
    expected = target.generate(prompt, **kwargs)
    assert len(set(expected[0, 7:].tolist())) >= 4, "degenerate target: the test would prove little"
    out = target.generate(prompt, assistant_model=drafter, **kwargs)
    assert torch.equal(out, expected)
    assert sum(drafter.last_acceptance_lengths) == 21


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_with_partial_acceptance(name, oracle):
    target = _supported(name)
    drafter = _drafter(target, block_size=5)
    prompt = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=30, do_sample=False, pad_token_id=PAD)
    expected = target.generate(prompt, **kwargs)
    oracle([expected[0]], corrupt=0.4, seed=2)
    out = target.generate(prompt, assistant_model=drafter, **kwargs)
    assert torch.equal(out, expected)
    lengths = drafter.last_acceptance_lengths
    assert sum(lengths) == 30
    assert any(1 < n < 5 for n in lengths) and any(n == 5 for n in lengths), lengths  # partial and whole blocks


@pytest.mark.parametrize("name", FAMILIES)
def test_left_padded_batch_equals_plain_batched_generate(name, oracle):
    target = _supported(name)
    drafter = _drafter(target, block_size=4)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g) for n in (3, 9, 6)]
    ids, mask = left_pad(prompts)
    kwargs = dict(max_new_tokens=14, do_sample=False, pad_token_id=PAD)
    expected = target.generate(ids, attention_mask=mask, **kwargs)
    oracle([expected[i, ids.shape[1] - len(p) :] for i, p in enumerate(prompts)], corrupt=0.3, seed=4)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, **kwargs)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("name", FAMILIES)
def test_from_target_builds_a_drafter(name):
    """Every family gets a drafter from `from_target` (RoPE from transformers' own initialisers, MoE widths)."""
    if not available(name):
        pytest.skip(f"{FAMILIES[name][0]} exists in transformers >= 5 only")
    target = make_family_target(name)
    drafter = make_drafter(target)
    assert drafter.config.hidden_size == target.config.hidden_size
    assert drafter.config.intermediate_size > 0


def test_unsupported_rows_are_refused():
    """Rows whose state cannot be rolled back in this transformers version fail early with a message naming it."""
    refused = []
    for name in FAMILIES:
        if not available(name):
            continue
        target = make_family_target(name)
        try:
            check_state_rollback(target)
        except ValueError as error:
            refused.append(name)
            drafter = make_drafter(target)
            with pytest.raises(ValueError, match="state"):
                target.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, assistant_model=drafter)
            assert "assistant_model" in str(error) or "Upgrade transformers" in str(error)
    expected = {4: {"lfm2", "granitemoehybrid", "falcon_h1"}, 5: set()}[MAJOR]
    assert set(refused) == expected


def test_gpt_oss_yarn_rope_comes_from_transformers():
    """gpt-oss uses yarn RoPE: the drafter takes transformers' own initialiser, attention scale included."""
    import math

    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    target = make_family_target("gpt_oss")
    drafter = make_drafter(target)
    params = drafter.config.rope_parameters
    assert params["rope_type"] == "yarn" and params["factor"] == 32.0
    rotary = drafter.rotary_emb
    assert math.isclose(rotary.attention_scaling, 0.1 * math.log(32.0) + 1.0)
    # the target's own rotary embedding (same head_dim here) has the same frequencies
    target_rotary = target.model.rotary_emb
    assert torch.allclose(rotary.inv_freq(torch.device("cpu")), target_rotary.inv_freq.float())
    assert "yarn" in ROPE_INIT_FUNCTIONS


def test_moe_config_without_a_dense_mlp_width_gets_the_documented_default():
    from transformers_dflash.configuration_dflash import DEFAULT_MLP_RATIO, decoder_shape_kwargs

    name = "qwen3_5_moe" if MAJOR >= 5 else "qwen3_next"
    target = make_family_target(name)
    config = target.config
    config.__dict__.pop("intermediate_size", None)  # as in Qwen3.5-MoE's own config class
    assert getattr(config, "intermediate_size", None) is None
    assert decoder_shape_kwargs(config)["intermediate_size"] == DEFAULT_MLP_RATIO * 32
    assert make_drafter(target).config.intermediate_size == DEFAULT_MLP_RATIO * 32
    assert make_drafter(target, intermediate_size=40).config.intermediate_size == 40
