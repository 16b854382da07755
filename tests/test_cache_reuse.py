"""A cache passed to generate() is continued and left as plain `generate()` leaves it: a cached prompt prefix, and the
turns of a conversation that pass one DynamicCache from call to call (transformers' "re-use the cache" patterns)."""

import copy

import pytest
import torch
from conftest import make_drafter, make_target, random_prompt
from families import available, make_family_target
from transformers import DynamicCache

from transformers_dflash.target_model import cache_keyword

pytestmark = pytest.mark.usefixtures("one_thread")


def _prefilled_cache(target, ids):
    cache = DynamicCache()
    with torch.no_grad():
        target(input_ids=ids, use_cache=True, **{cache_keyword(target): cache})
    return cache


def _generate(target, ids, cache, drafter=None, **kwargs):
    settings = {"max_new_tokens": 19, "do_sample": False, **kwargs}
    if drafter is not None:
        settings["assistant_model"] = drafter
    return target.generate(ids, **{cache_keyword(target): cache}, **settings)


def _assert_same_cache(mine, theirs):
    assert mine.get_seq_length() == theirs.get_seq_length()
    for layer, their_layer in zip(mine.layers, theirs.layers):
        torch.testing.assert_close(layer.keys, their_layer.keys)
        torch.testing.assert_close(layer.values, their_layer.values)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("use_oracle", [False, True])
def test_a_cached_prompt_prefix_is_continued_as_plain_generate_continues_it(arch, use_oracle, oracle):
    target = make_target(arch)
    drafter = make_drafter(target, block_size=4)
    prompt = random_prompt(13, seed=2)
    prefix = _prefilled_cache(target, prompt[:, :9])
    plain_cache, dflash_cache = copy.deepcopy(prefix), copy.deepcopy(prefix)
    expected = _generate(target, prompt, plain_cache)
    assert torch.equal(expected, target.generate(prompt, max_new_tokens=19, do_sample=False))
    if use_oracle:  # long accepts, partial accepts and rejections, the last block's included
        oracle([expected[0]])
    assert torch.equal(_generate(target, prompt, dflash_cache, drafter), expected)
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
    with pytest.raises(ValueError, match="no sliding window"):
        _generate(sliding, prompt, _prefilled_cache(sliding, prompt[:, :5]), make_drafter(sliding))


@pytest.mark.skipif(not available("qwen3_next"), reason="not in this transformers version")
def test_a_prefilled_cache_of_a_hybrid_target_is_refused():
    target = make_family_target("qwen3_next")
    prompt = random_prompt(8, seed=7)
    with torch.no_grad():
        cache = target(input_ids=prompt[:, :5], use_cache=True).past_key_values
    with pytest.raises(ValueError, match="cache"):
        _generate(target, prompt, cache, make_drafter(target))
