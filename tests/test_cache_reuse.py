"""A cache passed to generate() is continued and left as plain `generate()` leaves it: a cached prompt prefix, and the
turns of a conversation that pass one DynamicCache from call to call (transformers' "re-use the cache" patterns), on
attention-only targets and on hybrid ones (recurrent state, transformers >= 5)."""

import copy

import pytest
import torch
from conftest import make_drafter, make_target, random_prompt
from families import MAJOR, available, left_pad, make_family_target
from transformers import DynamicCache

from transformers_dflash.state_rollback import StateRollback
from transformers_dflash.target_model import cache_keyword

pytestmark = pytest.mark.usefixtures("one_thread")


def _prefilled_cache(target, ids, mask=None, cache=None):
    """`cache` (default: a DynamicCache) after the target read `ids`, at the positions generate() gives them (left
    padding skipped, as `mask` says)."""
    cache = DynamicCache() if cache is None else cache
    mask = torch.ones_like(ids) if mask is None else mask
    with torch.no_grad():
        target(
            input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=True,
            **{cache_keyword(target): cache},
        )  # fmt: skip
    return cache


def _generate(target, ids, cache, drafter=None, **kwargs):
    settings = {"max_new_tokens": 19, "do_sample": False, **kwargs}
    if drafter is not None:
        settings["assistant_model"] = drafter
    return target.generate(ids, **{cache_keyword(target): cache}, **settings)


def _recurrent_state(cache):
    stateful = hasattr(cache, "conv_states") or any(hasattr(layer, "conv_states") for layer in cache.layers)
    return [container[key] for container, key in StateRollback(cache)._state_slots()] if stateful else []


def _assert_same_cache(mine, theirs):
    """Same attention slots and, on hybrid targets, the same recurrent and convolution state (to float32 rounding:
    transformers' delta-rule kernels compute in float32, and a verified block takes the chunked one)."""
    assert mine.get_seq_length() == theirs.get_seq_length()
    if hasattr(mine, "key_cache"):  # transformers 4.57's Qwen3NextDynamicCache
        attention = [(k, v) for k, v in zip(mine.key_cache, mine.value_cache) if isinstance(k, torch.Tensor)]
        their_attention = [(k, v) for k, v in zip(theirs.key_cache, theirs.value_cache) if isinstance(k, torch.Tensor)]
    else:
        attention = [(layer.keys, layer.values) for layer in mine.layers if hasattr(layer, "keys")]
        their_attention = [(layer.keys, layer.values) for layer in theirs.layers if hasattr(layer, "keys")]
    state, their_state = _recurrent_state(mine), _recurrent_state(theirs)
    assert len(state) == len(their_state)
    tolerance = dict(rtol=1e-5, atol=1e-5) if state else {}  # the attention layers read the rounded state's outputs
    for tensor, their_tensor in zip(state, their_state):
        torch.testing.assert_close(tensor, their_tensor, **tolerance)
    assert len(attention) == len(their_attention) > 0
    for (keys, values), (their_keys, their_values) in zip(attention, their_attention):
        torch.testing.assert_close(keys, their_keys, **tolerance)
        torch.testing.assert_close(values, their_values, **tolerance)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("use_oracle", [False, True])
@pytest.mark.parametrize("padding", [0, 3])
def test_a_cached_prompt_prefix_is_continued_as_plain_generate_continues_it(arch, use_oracle, padding, oracle):
    """padding: the prompt is left-padded, so the cached prefix holds pad slots and the drafter's mask must leave out
    the prefix, whose features it never had (the drafter refuses a mask of another length than its keys)."""
    target = make_target(arch)
    drafter = make_drafter(target, block_size=4)
    prompt, mask = left_pad(random_prompt(13, seed=2), width=13 + padding)
    prefix = _prefilled_cache(target, prompt[:, :9], mask[:, :9])
    plain_cache, dflash_cache = copy.deepcopy(prefix), copy.deepcopy(prefix)
    expected = _generate(target, prompt, plain_cache, attention_mask=mask)
    assert torch.equal(expected, target.generate(prompt, attention_mask=mask, max_new_tokens=19, do_sample=False))
    if use_oracle:  # long accepts, partial accepts and rejections, the last block's included
        oracle([expected[0, padding:]])  # the oracle's positions, as the drafter's, leave the padding out
    assert torch.equal(_generate(target, prompt, dflash_cache, drafter, attention_mask=mask), expected)
    assert sum(drafter.last_acceptance_lengths) == expected.shape[1] - prompt.shape[1]
    if use_oracle:
        assert max(drafter.last_acceptance_lengths) > 1
    _assert_same_cache(dflash_cache, plain_cache)  # every token but the last; no rejected draft left in it


def test_a_conversation_passes_one_cache_from_turn_to_turn(oracle):
    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    follow_ups = [random_prompt(4, seed=10 + turn) for turn in range(3)]

    def converse(cache, drafter=None):
        ids, outputs = random_prompt(7, seed=3), []
        for follow_up in follow_ups:
            out = _generate(target, ids, cache, drafter, max_new_tokens=11)
            outputs.append(out)
            ids = torch.cat([out, follow_up], dim=1)
        return outputs

    plain_cache, dflash_cache = DynamicCache(), DynamicCache()
    expected = converse(plain_cache)
    oracle([out[0] for out in expected])
    for out, want in zip(converse(dflash_cache, drafter), expected):
        assert torch.equal(out, want)
    _assert_same_cache(dflash_cache, plain_cache)


@pytest.mark.parametrize("stop_at_eos", [False, True])
def test_the_returned_cache_of_one_prompt_holds_what_plain_generate_leaves(stop_at_eos, oracle):
    """With an EOS the oracle drafts past (its references run on), the last block's slots after the EOS must go."""
    target = make_target("llama", eos_token_id=None)
    drafter = make_drafter(target, block_size=5)
    prompt = random_prompt(6, seed=7)
    settings = dict(max_new_tokens=23, do_sample=False, return_dict_in_generate=True)
    reference = target.generate(prompt, **settings).sequences[0]
    oracle([reference])
    if stop_at_eos:  # the first answer token from the 9th on that did not occur before it
        answer = reference[prompt.shape[1] :].tolist()
        settings["eos_token_id"] = next(t for i, t in enumerate(answer) if i >= 8 and t not in answer[:i])
    expected = target.generate(prompt, **settings)
    out = target.generate(prompt, assistant_model=drafter, **settings)
    assert torch.equal(out.sequences, expected.sequences)
    assert (expected.sequences.shape[1] < reference.shape[0]) is stop_at_eos
    field = "cache" if hasattr(out, "cache") else "past_key_values"
    _assert_same_cache(getattr(out, field), getattr(expected, field))


def test_a_prefilled_cache_is_refused_where_it_cannot_be_continued():
    target = make_target("llama")
    drafter = make_drafter(target)
    prompt = random_prompt(8, seed=5)
    with pytest.raises(ValueError, match="at least one token the cache has not seen"):
        _generate(target, prompt, _prefilled_cache(target, prompt), drafter)
    batch = random_prompt(8, seed=6, batch=2)
    with pytest.raises(ValueError, match="only for a single prompt"):
        _generate(target, batch, _prefilled_cache(target, batch[:, :5]), drafter)
    sliding = make_target("mistral", dtype=torch.float32)
    with pytest.raises(ValueError, match="without sliding-window layers"):
        _generate(sliding, prompt, _prefilled_cache(sliding, prompt[:, :5]), make_drafter(sliding))


HYBRIDS = [name for name in ("qwen3_5", "qwen3_next") if available(name)]


def _hybrid(name):
    """A tiny hybrid target and a drafter (the oracle makes it verify whole blocks: partial accepts in most steps).
    "qwen3_5_vl": Qwen3_5ForConditionalGeneration, the layout of Qwen3.6-27B, whose multimodal RoPE positions that
    generate() prepares for the whole prompt are cut to the tokens the cache has not seen."""
    if name == "qwen3_5_vl":
        from test_hybrid import _qwen3_5_vl

        target = _qwen3_5_vl()
    else:
        target = make_family_target(name)
    return target, make_drafter(target, block_size=4)


def _hybrid_cache(target):
    """The cache plain generate() builds for a hybrid target (linear-attention layers beside attention ones)."""
    return DynamicCache(config=target.config)


@pytest.mark.skipif(MAJOR < 5, reason="hybrid caches are continued with transformers >= 5 only")
@pytest.mark.parametrize(
    "name, padding", [*((name, 0) for name in HYBRIDS), *((name, 3) for name in HYBRIDS), ("qwen3_5_vl", 0)]
)
def test_a_hybrid_target_continues_a_cached_prompt_prefix(name, padding, oracle):
    target, drafter = _hybrid(name)
    prompt, mask = left_pad(random_prompt(13, seed=2), width=13 + padding)
    prefix = _prefilled_cache(target, prompt[:, :9], mask[:, :9], _hybrid_cache(target))
    plain_cache, dflash_cache = copy.deepcopy(prefix), copy.deepcopy(prefix)
    expected = _generate(target, prompt, plain_cache, attention_mask=mask)
    assert torch.equal(expected, target.generate(prompt, attention_mask=mask, max_new_tokens=19, do_sample=False))
    oracle([expected[0, padding:]])  # long and partial accepts: the state is rolled back in many steps
    assert torch.equal(_generate(target, prompt, dflash_cache, drafter, attention_mask=mask), expected)
    assert max(drafter.last_acceptance_lengths) > 1
    _assert_same_cache(dflash_cache, plain_cache)


@pytest.mark.skipif(MAJOR < 5, reason="hybrid caches are continued with transformers >= 5 only")
def test_a_conversation_with_a_hybrid_target_passes_one_cache_from_turn_to_turn(oracle):
    target, drafter = _hybrid("qwen3_5")
    follow_ups = [random_prompt(4, seed=10 + turn) for turn in range(3)]

    def converse(cache, drafter=None):
        ids, outputs = random_prompt(7, seed=3), []
        for follow_up in follow_ups:
            # the answers may hold the pad token: the mask says every token counts, as a tokenizer's would
            out = _generate(target, ids, cache, drafter, max_new_tokens=11, attention_mask=torch.ones_like(ids))
            outputs.append(out)
            ids = torch.cat([out, follow_up], dim=1)
        return outputs

    plain_cache, dflash_cache = _hybrid_cache(target), _hybrid_cache(target)
    expected = converse(plain_cache)
    oracle([out[0] for out in expected])
    for out, want in zip(converse(dflash_cache, drafter), expected):
        assert torch.equal(out, want)
    _assert_same_cache(dflash_cache, plain_cache)


@pytest.mark.parametrize("name", HYBRIDS)
def test_the_returned_cache_of_a_hybrid_target_holds_no_rejected_draft(name, oracle):
    """Stopped by an EOS inside a block the oracle drafts past: the recurrent state must not have read the drafts
    after it (both transformers versions; 4.57's Qwen3-Next has its own cache class)."""
    target, drafter = _hybrid(name)
    prompt = random_prompt(6, seed=7)
    settings = dict(max_new_tokens=23, do_sample=False, return_dict_in_generate=True)
    reference = target.generate(prompt, **settings).sequences[0]
    oracle([reference], corrupt=0.0)  # every draft accepted: blocks of 4 commit answer tokens 1-4, 5-8, ...
    answer = reference[prompt.shape[1] :].tolist()
    # An EOS that is not the last token of its block, so that verification reads drafts past it.
    settings["eos_token_id"] = next(t for i, t in enumerate(answer) if i >= 9 and i % 4 and t not in answer[:i])
    expected = target.generate(prompt, **settings)
    out = target.generate(prompt, assistant_model=drafter, **settings)
    assert torch.equal(out.sequences, expected.sequences)
    assert expected.sequences.shape[1] < reference.shape[0]
    assert drafter.last_acceptance_lengths[-1] < 4
    field = "cache" if hasattr(out, "cache") else "past_key_values"
    _assert_same_cache(getattr(out, field), getattr(expected, field))


@pytest.mark.skipif(not available("qwen3_next") or MAJOR >= 5, reason="transformers 4.57's Qwen3-Next only")
def test_a_prefilled_cache_of_a_legacy_hybrid_target_is_refused():
    target = make_family_target("qwen3_next")
    prompt = random_prompt(8, seed=7)
    with torch.no_grad():
        cache = target(input_ids=prompt[:, :5], use_cache=True).past_key_values
    with pytest.raises(ValueError, match="cache"):
        _generate(target, prompt, cache, make_drafter(target))
