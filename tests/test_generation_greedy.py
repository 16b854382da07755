"""Greedy DFlash decoding must return exactly what plain `generate()` returns, whatever the drafter proposes."""

import random

import pytest
import torch
from conftest import ARCHITECTURES, EOS, PAD, make_drafter, make_target, random_prompt


def _cases():
    rng = random.Random(1234)
    archs = list(ARCHITECTURES)
    cases = []
    for i in range(24):
        block_size = rng.choice([2, 3, 4, 5, 8, 16])
        cases.append(
            dict(
                arch=archs[i % len(archs)],
                attn=["eager", "sdpa"][(i // len(archs)) % 2],
                block_size=block_size,
                prompt_len=rng.choice([1, 2, 5, 11, 23]),
                # edge cases: 1 token, fewer than a block, exactly a block, several blocks
                max_new_tokens=rng.choice([1, block_size - 1, block_size, 2 * block_size + 1, 40]),
                eos=rng.random() < 0.5,
                use_oracle=rng.random() < 0.7,
                seed=i,
            )
        )
    return cases


@pytest.mark.parametrize(
    "case", _cases(), ids=lambda c: "{arch}-{attn}-B{block_size}-L{prompt_len}-N{max_new_tokens}".format(**c)
)
def test_greedy_equals_plain_generate(case, oracle):
    target = make_target(case["arch"], case["attn"], seed=case["seed"], eos_token_id=EOS if case["eos"] else None)
    drafter = make_drafter(target, block_size=case["block_size"], seed=case["seed"] + 100)
    prompt = random_prompt(case["prompt_len"], seed=case["seed"])
    kwargs = dict(max_new_tokens=case["max_new_tokens"], do_sample=False, pad_token_id=PAD)
    expected = target.generate(prompt, **kwargs)
    if case["use_oracle"]:
        oracle([expected[0]])
    out = target.generate(prompt, assistant_model=drafter, **kwargs)
    assert torch.equal(out, expected)
    lengths = drafter.last_acceptance_lengths
    assert sum(lengths) == out.shape[1] - prompt.shape[1]
    assert lengths[0] == 1 and all(1 <= n <= case["block_size"] for n in lengths)


def test_oracle_drafts_are_accepted(oracle):
    """With perfect proposals every verification step commits a whole block: proves the accept path is taken."""
    target = make_target("llama", eos_token_id=None)
    drafter = make_drafter(target, block_size=5)
    prompt = random_prompt(6, seed=3)
    expected = target.generate(prompt, max_new_tokens=41, do_sample=False)
    oracle([expected[0]], corrupt=0.0)
    out = target.generate(prompt, max_new_tokens=41, do_sample=False, assistant_model=drafter)
    assert torch.equal(out, expected)
    assert drafter.last_acceptance_lengths == [1] + [5] * 8


def test_eos_inside_an_accepted_block_ends_generation_there(oracle):
    target = make_target("qwen3", eos_token_id=None)
    prompt = random_prompt(5, seed=7)
    free_run = target.generate(prompt, max_new_tokens=30, do_sample=False)[0, 5:].tolist()
    eos = free_run[9]  # declare the 10th generated token to be EOS: generation must stop right after it
    first = free_run.index(eos)
    target.generation_config.eos_token_id = eos
    expected = target.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    assert expected.shape[1] == 5 + first + 1
    drafter = make_drafter(target, block_size=8)
    oracle([torch.tensor(prompt[0].tolist() + free_run)], corrupt=0.0)
    out = target.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=eos, assistant_model=drafter)
    assert torch.equal(out, expected)


def test_stop_string_inside_a_block(oracle):
    from transformers import StoppingCriteria, StoppingCriteriaList

    target = make_target("llama", eos_token_id=None)
    prompt = random_prompt(4, seed=11)
    free_run = target.generate(prompt, max_new_tokens=30, do_sample=False)[0, 4:].tolist()
    stop_pair = free_run[6:8]

    class StopOnPair(StoppingCriteria):  # what StopStringCriteria does, without a tokenizer
        def __call__(self, input_ids, scores, **kwargs):
            return torch.tensor([row[-2:].tolist() == stop_pair for row in input_ids])

    kwargs = dict(max_new_tokens=30, do_sample=False, stopping_criteria=StoppingCriteriaList([StopOnPair()]))
    expected = target.generate(prompt, **kwargs)
    drafter = make_drafter(target, block_size=6)
    oracle([torch.tensor(prompt[0].tolist() + free_run)], corrupt=0.0)
    out = target.generate(prompt, assistant_model=drafter, **kwargs)
    assert torch.equal(out, expected)
    assert out[0, -2:].tolist() == stop_pair


@pytest.mark.parametrize(
    "processors",
    [
        dict(repetition_penalty=1.3),
        dict(no_repeat_ngram_size=2),
        dict(min_new_tokens=12, eos_token_id=EOS),
        dict(suppress_tokens=[5, 6, 7], bad_words_ids=[[9]]),
    ],
    ids=["repetition_penalty", "no_repeat_ngram", "min_new_tokens", "suppress_bad_words"],
)
def test_greedy_with_logits_processors(processors, oracle):
    target = make_target("qwen2", eos_token_id=None)
    drafter = make_drafter(target, block_size=4)
    prompt = random_prompt(7, seed=5)
    kwargs = dict(max_new_tokens=25, do_sample=False, **processors)
    expected = target.generate(prompt, **kwargs)
    oracle([expected[0]], corrupt=0.3)
    assert torch.equal(target.generate(prompt, assistant_model=drafter, **kwargs), expected)


def test_return_dict_scores_and_logits(oracle):
    target = make_target("llama", eos_token_id=None)
    drafter = make_drafter(target, block_size=4)
    prompt = random_prompt(5, seed=2)
    kwargs = dict(
        max_new_tokens=13,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
        repetition_penalty=1.2,
    )
    expected = target.generate(prompt, **kwargs)
    oracle([expected.sequences[0]], corrupt=0.3)
    out = target.generate(prompt, assistant_model=drafter, **kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    assert len(out.scores) == len(expected.scores) == 13
    for ours, theirs in zip(out.scores, expected.scores):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(out.logits, expected.logits):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_streamer_receives_the_same_tokens(oracle):
    from transformers.generation.streamers import BaseStreamer

    class Collect(BaseStreamer):
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    target = make_target("llama", eos_token_id=None)
    drafter = make_drafter(target, block_size=4)
    prompt = random_prompt(5, seed=9)
    expected = target.generate(prompt, max_new_tokens=20, do_sample=False)
    oracle([expected[0]], corrupt=0.2)
    streamer = Collect()
    target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=drafter, streamer=streamer)
    assert streamer.ended
    assert streamer.chunks[0] == prompt[0].tolist()  # generate() puts the prompt first
    assert sum(streamer.chunks[1:], []) == expected[0, 5:].tolist()
    assert [len(c) for c in streamer.chunks[1:]] == drafter.last_acceptance_lengths


def test_float32_and_untrained_drafter_never_change_output():
    target = make_target("qwen3", dtype=torch.float32, eos_token_id=None)
    drafter = make_drafter(target, num_layers=1, block_size=16)
    for seed in range(3):
        prompt = random_prompt(9 + seed, seed=seed)
        expected = target.generate(prompt, max_new_tokens=35, do_sample=False)
        assert torch.equal(
            target.generate(prompt, max_new_tokens=35, do_sample=False, assistant_model=drafter), expected
        )


def test_drafter_in_another_dtype_works_and_is_left_alone():
    target = make_target("llama", dtype=torch.float64, eos_token_id=None)
    drafter = make_drafter(target).to(torch.float32)
    prompt = random_prompt(5, seed=1)
    expected = target.generate(prompt, max_new_tokens=10, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=10, do_sample=False, assistant_model=drafter), expected)
    assert next(drafter.parameters()).dtype == torch.float32


def test_rope_survives_dtype_casts_and_reloading(tmp_path):
    from transformers_dflash.modeling_dflash import _rope_inverse_frequencies

    target = make_target("llama", dtype=torch.float32)
    drafter = make_drafter(target).to(torch.bfloat16)
    exact = _rope_inverse_frequencies(drafter.config)
    assert torch.equal(drafter.rotary_emb.inv_freq(torch.device("cpu")), exact)
    drafter.save_pretrained(tmp_path)
    reloaded = type(drafter).from_pretrained(tmp_path)
    assert torch.equal(reloaded.rotary_emb.inv_freq(torch.device("cpu")), exact)


def test_speculation_type_dflash_call_convention():
    target = make_target("llama", eos_token_id=None)
    drafter = make_drafter(target)
    prompt = random_prompt(5, seed=1)
    expected = target.generate(prompt, max_new_tokens=12, do_sample=False)
    out = target.generate(
        prompt, max_new_tokens=12, do_sample=False, assistant_model=drafter, speculation_type="dflash"
    )
    assert torch.equal(out, expected)


def test_other_assistants_are_untouched(monkeypatch):
    """A classic assistant model and prompt lookup give what they give without our package, via transformers' own
    candidate generators."""
    from transformers.generation.utils import GenerationMixin

    target = make_target("llama")  # transformers 4.57's prompt lookup needs an EOS id
    assistant = make_target("llama", seed=3, num_layers=1)
    prompt = random_prompt(8, seed=4)
    calls = []
    original = GenerationMixin._get_candidate_generator

    def spy(self, *args, **kwargs):
        generator = original(self, *args, **kwargs)
        calls.append(type(generator).__name__)
        return generator

    monkeypatch.setattr(GenerationMixin, "_get_candidate_generator", spy)

    def run():
        return (
            target.generate(prompt, max_new_tokens=15, do_sample=False, assistant_model=assistant),
            target.generate(prompt, max_new_tokens=15, do_sample=False, prompt_lookup_num_tokens=3),
        )

    with_hook = run()
    for name, method in GenerationMixin._dflash_original_methods.items():
        monkeypatch.setattr(GenerationMixin, name, method)
    without_hook = run()
    assert all(torch.equal(a, b) for a, b in zip(with_hook, without_hook))
    assert calls == ["AssistedCandidateGenerator", "PromptLookupCandidateGenerator"] * 2


def test_candidate_generator_protocol_in_transformers_own_loop(monkeypatch, oracle):
    """`DFlashCandidateGenerator` also serves transformers' stock batch-1 assisted loop through the standard
    `get_candidates` / `update_candidate_strategy` protocol."""
    from transformers.generation.utils import GenerationMixin

    from transformers_dflash import DFlashCandidateGenerator

    target = make_target("llama", eos_token_id=None)
    drafter = make_drafter(target, block_size=5)
    prompt = random_prompt(6, seed=8)
    expected = target.generate(prompt, max_new_tokens=23, do_sample=False)
    oracle([expected[0]], corrupt=0.3)
    monkeypatch.setattr(
        GenerationMixin, "_assisted_decoding", GenerationMixin._dflash_original_methods["_assisted_decoding"]
    )
    monkeypatch.setattr(
        GenerationMixin,
        "_get_candidate_generator",
        lambda self, generation_config, **kwargs: DFlashCandidateGenerator(drafter, self, generation_config),
    )
    out = target.generate(prompt, max_new_tokens=23, do_sample=False, assistant_model=drafter)
    assert torch.equal(out, expected)
    assert max(drafter.last_acceptance_lengths) > 1  # drafts were accepted through the protocol


def test_half_precision_drafter_next_to_float32_target_warns_once_and_stays_lossless(caplog, monkeypatch):
    """A bfloat16 drafter (the shipped weights' dtype) with a float32 target on CPU drafts slowly: say so, once."""
    import logging

    from transformers_dflash import candidate_generator as generation_dflash

    monkeypatch.setattr(generation_dflash, "_warned_dtypes", set())
    monkeypatch.setattr(generation_dflash, "bfloat16_is_fast", lambda device: False)  # as on most CPUs
    target = make_target("llama", dtype=torch.float32)
    drafter = make_drafter(target, block_size=4).to(torch.bfloat16)
    input_ids = random_prompt(9, seed=3)
    expected = target.generate(input_ids, max_new_tokens=12, do_sample=False)
    with caplog.at_level(logging.WARNING, logger=generation_dflash.__name__):
        for _ in range(2):
            out = target.generate(input_ids, assistant_model=drafter, max_new_tokens=12, do_sample=False)
            assert torch.equal(out, expected)
    assert caplog.text.count("dtype=target.dtype") == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=generation_dflash.__name__):
        target.generate(input_ids, assistant_model=drafter.float(), max_new_tokens=12, do_sample=False)
    assert "dtype=target.dtype" not in caplog.text


def test_bfloat16_drafter_is_not_warned_about_on_cpus_with_bfloat16_instructions(caplog, monkeypatch):
    """Where the CPU has AMX or AVX512-BF16, bfloat16 products are the fast ones: no warning there; float16 still."""
    import logging

    from transformers_dflash import candidate_generator as generation_dflash

    monkeypatch.setattr(generation_dflash, "_warned_dtypes", set())
    monkeypatch.setattr(generation_dflash, "bfloat16_is_fast", lambda device: True)
    target = make_target("llama", dtype=torch.float32)
    input_ids = random_prompt(9, seed=3)
    expected = target.generate(input_ids, max_new_tokens=12, do_sample=False)
    for dtype, warned in ((torch.bfloat16, False), (torch.float16, True)):
        drafter = make_drafter(target, block_size=4).to(dtype)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=generation_dflash.__name__):
            out = target.generate(input_ids, assistant_model=drafter, max_new_tokens=12, do_sample=False)
        assert torch.equal(out, expected)
        assert ("dtype=target.dtype" in caplog.text) is warned, dtype
