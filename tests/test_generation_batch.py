"""Batched DFlash decoding: every row of a left-padded batch equals plain `generate()` on that row alone.

These tests run in float32: transformers' eager attention turns fully padded query rows into NaN in float64.
"""

import random

import pytest
import torch
from conftest import PAD, VOCAB, make_drafter, make_target, random_prompt
from families import left_pad


def _assert_rows_match(out, prompts, singles):
    width = max(len(p) for p in prompts)
    for row, (prompt, single) in enumerate(zip(prompts, singles)):
        start = width - len(prompt)
        got = out[row, start : start + single.shape[0]]
        assert torch.equal(got, single), f"row {row} differs from its single-row generate()"
        assert (out[row, start + single.shape[0] :] == PAD).all(), f"row {row} is not padded after its end"
        assert (out[row, :start] == PAD).all()


@pytest.mark.parametrize("seed", range(6))
def test_batch_rows_equal_single_row_generate(seed, oracle):
    rng = random.Random(seed)
    arch = ["llama", "qwen3", "mistral", "gemma", "qwen2", "gemma2"][seed]
    batch = [1, 2, 3, 5, 8, 4][seed]
    block_size = rng.choice([3, 4, 6, 8])
    max_new = rng.choice([9, 20, 31])
    target = make_target(arch, attn=rng.choice(["eager", "sdpa"]), dtype=torch.float32, seed=seed, eos_token_id=None)
    drafter = make_drafter(target, block_size=block_size, seed=seed)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, VOCAB, (rng.randint(1, 14),), generator=g) for _ in range(batch)]

    # EOS tokens that rows hit at different steps (some rows may never hit them and run to max_new_tokens)
    free = [target.generate(p[None], max_new_tokens=max_new, do_sample=False)[0, len(p) :] for p in prompts]
    eos = sorted({int(f[rng.randrange(len(f))]) for f in free[: max(1, batch // 2)]})
    kwargs = dict(max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=PAD)
    singles = [target.generate(p[None], **kwargs)[0] for p in prompts]
    oracle(singles, corrupt=0.3)
    ids, mask = left_pad(prompts)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, **kwargs)
    _assert_rows_match(out, prompts, singles)
    lengths = drafter.last_acceptance_lengths
    if batch == 1:
        lengths = [lengths]
    for row, single in enumerate(singles):
        assert sum(lengths[row]) == single.shape[0] - len(prompts[row])


def test_batch_with_untrained_drafter_and_processors():
    target = make_target("llama", dtype=torch.float32, eos_token_id=None)
    drafter = make_drafter(target, block_size=5)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g) for n in (3, 9, 6)]
    kwargs = dict(max_new_tokens=17, do_sample=False, repetition_penalty=1.4, pad_token_id=PAD)
    singles = [target.generate(p[None], **kwargs)[0] for p in prompts]
    ids, mask = left_pad(prompts)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, **kwargs)
    _assert_rows_match(out, prompts, singles)


@pytest.mark.parametrize("groups", [None, [[1], [2], [0], [3]], [[1, 2], [0, 3]]])
def test_prefill_with_or_without_the_padding_is_lossless(groups, monkeypatch):
    from transformers_dflash import decoding

    target = make_target("qwen3", dtype=torch.float32, eos_token_id=None)
    drafter = make_drafter(target, block_size=4)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g) for n in (2, 13, 7, 1)]
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=PAD)
    singles = [target.generate(p[None], **kwargs)[0] for p in prompts]
    calls = []
    grouped = decoding.grouped_prefill
    monkeypatch.setattr(decoding, "prefill_groups", lambda mask, target: groups)
    monkeypatch.setattr(decoding, "grouped_prefill", lambda *args: calls.append(1) or grouped(*args))
    ids, mask = left_pad(prompts)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, **kwargs)
    _assert_rows_match(out, prompts, singles)
    assert len(calls) == (0 if groups is None else 1)


def test_prefill_groups_rule():
    from transformers_dflash.prefill import prefill_groups

    target = make_target("llama", dtype=torch.float32, eos_token_id=None)

    def groups(lengths, model=target):
        width = max(lengths)
        mask = (torch.arange(width)[None] >= torch.tensor([width - n for n in lengths])[:, None]).long()
        found = prefill_groups(mask, model)
        return found and [[lengths[r] for r in group] for group in found]

    # The 16 MT-Bench prompts of the batched bench: 3 forwards over 1,638 slots instead of one over 4,576.
    mtbench = [53, 60, 64, 90, 68, 106, 65, 54, 56, 59, 210, 286, 54, 69, 58, 49]
    assert groups(mtbench) == [[286, 210], [106, 90, 69], [68, 65, 64, 60, 59, 58, 56, 54, 54, 53, 49]]
    assert groups(mtbench[:8]) == [[106, 90, 68], [65, 64, 60, 54, 53]]  # 643 of 848 slots
    assert groups(mtbench[:4]) is None  # 300 of 360 slots: not worth a forward more
    assert groups([9]) is None and groups([5, 5, 5]) is None
    assert groups(mtbench, make_target("mistral", dtype=torch.float32)) is None  # sliding window: padded prefill


def test_grouped_prefill_lays_out_the_padded_prefills_cache():
    from transformers import DynamicCache

    from transformers_dflash import DFlashCandidateGenerator
    from transformers_dflash.prefill import grouped_prefill
    from transformers_dflash.target_model import cache_keyword

    target = make_target("llama", dtype=torch.float32, eos_token_id=None)
    drafter = make_drafter(target, block_size=4)
    g = torch.Generator().manual_seed(0)
    ids, mask = left_pad([torch.randint(3, VOCAB, (n,), generator=g) for n in (9, 3, 6, 2)])
    keyword = cache_keyword(target)
    generator = DFlashCandidateGenerator(drafter, target)
    with torch.no_grad():
        padded_cache = DynamicCache()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        padded = target(input_ids=ids, attention_mask=mask, position_ids=positions, **{keyword: padded_cache})
        padded_features = generator.captured_features()
        cache = DynamicCache()

        def target_forward(ids, position_ids, mask, keep, into):
            kwargs = dict(position_ids=position_ids, attention_mask=mask, logits_to_keep=keep, **{keyword: into})
            return target(input_ids=ids, use_cache=True, **kwargs).logits

        logits, features = grouped_prefill(target_forward, generator, ids, mask, [[2, 1], [0], [3]], cache)
    generator.close()
    valid = mask.bool()
    torch.testing.assert_close(logits[:, 0], padded.logits[:, -1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(features[valid], padded_features[valid], rtol=1e-4, atol=1e-5)
    assert cache.get_seq_length() == padded_cache.get_seq_length() == ids.shape[1]
    for layer, padded_layer in zip(cache.layers, padded_cache.layers):
        for mine, theirs in ((layer.keys, padded_layer.keys), (layer.values, padded_layer.values)):
            torch.testing.assert_close(mine.transpose(1, 2)[valid], theirs.transpose(1, 2)[valid], rtol=1e-4, atol=1e-5)


def test_right_padding_is_refused_clearly():
    target = make_target("llama")
    drafter = make_drafter(target)
    ids = torch.tensor([[5, 6, 7, PAD], [5, 6, 7, 8]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    with pytest.raises(ValueError, match="padding_side='left'"):
        target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=4)


def test_mask_shape_mismatch_is_refused_clearly():
    target = make_target("llama")
    drafter = make_drafter(target)
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8]])
    with pytest.raises(ValueError, match="attention_mask has shape"):
        target.generate(
            ids, attention_mask=torch.ones(2, 3, dtype=torch.long), assistant_model=drafter, max_new_tokens=4
        )


@pytest.mark.parametrize("draft_length", [0.0, 0.3, 0.9, "auto"])
def test_adaptive_draft_length_is_lossless(draft_length, oracle):
    target = make_target("qwen3", dtype=torch.float32, eos_token_id=None)
    drafter = make_drafter(target, block_size=8)
    drafter.draft_length = draft_length
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g) for n in (4, 10, 7)]
    kwargs = dict(max_new_tokens=30, do_sample=False, pad_token_id=PAD)
    singles = [target.generate(p[None], **kwargs)[0] for p in prompts]
    oracle(singles, corrupt=0.3)
    ids, mask = left_pad(prompts)
    _assert_rows_match(target.generate(ids, attention_mask=mask, assistant_model=drafter, **kwargs), prompts, singles)
    assert torch.equal(target.generate(prompts[0][None], assistant_model=drafter, **kwargs)[0], singles[0])


def test_draft_length_policy_rules():
    from transformers_dflash.draft_length import AutoDraftLength, ConfidenceThreshold, draft_length_policy

    confidence = torch.tensor([[0.9, 0.9, 0.5, 0.9], [0.95, 0.2, 0.9, 0.9]])  # cumulative: .9 .81 .405 .36 / .95 .19
    drafts = torch.zeros(2, 4, dtype=torch.long)
    assert ConfidenceThreshold(0.5).trim(drafts, confidence).shape[1] == 2  # the widest row wins
    assert ConfidenceThreshold(0.95).trim(drafts, confidence).shape[1] == 1
    auto = AutoDraftLength()
    assert auto.num_to_verify(confidence) == 1  # explores one draft first...
    assert auto.wants_draft()
    auto.record(2, 0.4)  # 0.2 s per verified token on top of 0 s: verification cost dominates
    assert not auto.wants_draft()  # ... then a plain step (width 1) is measured, without paying for a draft
    assert auto.num_to_verify(confidence) == 0  # (copied drafts alone are not verified then either)
    auto.record(1, 0.2)
    assert auto.num_to_verify(confidence) == 0
    assert auto.step_costs(5) == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])  # measured where it can, else the line
    for _ in range(AutoDraftLength.TRUSTED):  # a width measured often enough replaces the line's guess, ...
        auto.record(5, 0.5)
    auto.record(2, 0.4)
    auto.record(2, 0.4)
    assert auto.step_costs(5) == pytest.approx([0.2, 0.4, 0.4333, 0.4667, 0.5], abs=1e-3)  # ... interpolated between
    # Fewer steps of a width than that: it costs at most what the line through all steps says, so that one slow step
    # does not make it look dear for good (it would never be chosen, so never measured again).
    noisy = AutoDraftLength()
    for width, seconds in [(2, 1.0)] * 10 + [(1, 0.9)] * 3 + [(3, 1.8)]:
        noisy.record(width, seconds)
    line = noisy._cost_line()
    assert noisy.step_costs(3)[2] == pytest.approx(line[0] + 3 * line[1]) and noisy.step_costs(3)[2] < 1.8
    assert noisy.num_to_verify(torch.full((1, 2), 0.9)) == 2  # so two confident drafts are verified again
    noisy.record(3, 1.8)
    noisy.record(3, 1.8)
    assert noisy.step_costs(3)[2] == pytest.approx(1.8)  # measured three times: its mean, slow as it is
    assert noisy.num_to_verify(torch.full((1, 2), 0.9)) == 1
    # A plain step (width 1) is what drafting is weighed against: measured once, it keeps its measured cost even
    # where the line says less, so that drafting does not look worse than it is.
    plain_once = AutoDraftLength()
    for width, seconds in [(2, 1.0)] * 10 + [(8, 2.2)] * 5 + [(1, 1.0)]:
        plain_once.record(width, seconds)
    intercept, slope = plain_once._cost_line()
    assert intercept + slope < 1.0 and plain_once.step_costs(2)[0] == pytest.approx(1.0)
    cheap = AutoDraftLength()
    cheap.record(2, 1.0)
    cheap.record(1, 0.99)  # nearly free extra tokens (a GPU): verify everything, untried widths included
    assert cheap.num_to_verify(confidence) == 4
    # A large batch: one more token per row costs as much as the step. Even confident drafts are not worth it, and
    # the full block is never tried (it would cost five plain steps just to learn that).
    large = AutoDraftLength()
    large.record(2, 2.0)
    large.record(1, 1.0)
    assert large.num_to_verify(torch.full((1, 4), 0.9)) == 0
    # The first draft also read the prompt's context: later drafts tell the draft's cost.
    large.record(1, 1.0, draft_seconds=30.0)
    large.record(1, 1.0, draft_seconds=0.1)
    assert large.num_to_verify(torch.full((1, 4), 0.99)) >= 1  # 1.99 tokens in 2.1 s > 1 in 1.1 s (not in 17 s)
    # A CPU: one token is cheap, two to five cost the same. Confident drafts are worth it, doubtful ones are not.
    cpu = AutoDraftLength()
    for width, seconds in ((5, 1.7), (2, 1.7), (1, 1.0)):
        cpu.record(width, seconds)
    assert cpu.num_to_verify(confidence) == 4  # row 0: 1 + .9 + .81 + .41 + .36 = 3.5 tokens in 1.7 s > 1 in 1.0
    doubtful = torch.tensor([[0.3, 0.3, 0.3, 0.3]])
    assert cpu.num_to_verify(doubtful) == 0  # 1.43 tokens in 1.7 s < 1 token in 1.0 s: a plain step
    # A batch shares the forward: one confident row does not make the doubtful rows' drafts worth verifying.
    batch = AutoDraftLength()
    for width, seconds in ((5, 2.5), (2, 2.5), (1, 1.0)):
        batch.record(width, seconds)
    rows = torch.tensor([[0.99] * 4, [0.01] * 4, [0.01] * 4])
    assert batch.num_to_verify(rows[:1]) == 4  # alone: 4.9 tokens in 2.5 s > 1 token in 1 s
    assert batch.num_to_verify(rows) == 0  # together: 6.9 tokens in 2.5 s < 3 tokens in 1 s
    # With the draft's cost (0.5 s) paid, verifying is worth it (6.9 tokens in 3 s > 3 in 1.5 s), but the drafted step
    # (2.3 tokens/s) still loses to plain steps (3 tokens/s): skip the drafter, asking it again after 1, 2, 4 ...
    # skipped steps; as soon as drafting wins, draft every step again.
    batch.record(1, 1.0, draft_seconds=0.5)
    assert batch.num_to_verify(rows) == 4
    pattern = [batch.wants_draft() for _ in range(1 + 1 + 2 + 1)]
    assert pattern == [False, True, False, False, True]
    assert batch.num_to_verify(rows[:1]) == 4  # a confident batch: 4.9 tokens in 3 s > 1 token in 1 s
    assert all(batch.wants_draft() for _ in range(3))
    assert all(ConfidenceThreshold(0.5).wants_draft() for _ in range(3))  # only "auto" skips
    for bad in (1.5, True, "fast"):
        with pytest.raises(ValueError, match="draft_length"):
            draft_length_policy(bad)
    assert type(draft_length_policy(None, "cpu")) is AutoDraftLength  # the measured CPU default
    assert type(draft_length_policy(None, "meta")).__name__ == "FullBlock"  # accelerators verify whole blocks


def test_auto_step_costs_follow_every_recorded_step():
    """`step_costs` is computed once per change of the step times and sliced for narrower asks: a narrow ask, then a
    wider one, then a new step all give what a fresh computation from the same steps gives."""
    from transformers_dflash.draft_length import AutoDraftLength

    steps = [(2, 1.0), (1, 0.5), (3, 1.2), (1, 0.6), (2, 0.9), (5, 2.0), (3, 1.1), (1, 0.55), (3, 1.3), (8, 3.0)]
    policy = AutoDraftLength()
    for number, (width, seconds) in enumerate(steps, start=1):
        policy.record(width, seconds)
        fresh = AutoDraftLength()
        for recorded in steps[:number]:
            fresh.record(*recorded)
        for max_width in (2, 6, 3, 9):
            assert policy.step_costs(max_width) == fresh.step_costs(max_width)
            assert (fresh.step_costs(max_width) is None) == (number < 2)
    assert policy.step_costs(9)[:4] == policy.step_costs(4)
    before = policy.step_costs(4)
    policy.start_call()  # keeps the steps (fewer than KEPT per width): the same table
    assert policy.step_costs(4) == before
    policy.record(4, 0.1)  # a new step changes the table at once
    assert policy.step_costs(4) != before


def test_auto_stops_drafting_when_the_drafted_steps_realise_less_than_plain_steps():
    """An overconfident drafter: its drafts look worth verifying, but the drafted steps commit fewer tokens per second
    than plain steps do. "auto" then skips the drafter (asking it again after 1, 2, 4 ... skipped steps), and drafts
    every step again once the drafted steps pay."""
    from transformers_dflash.draft_length import AutoDraftLength

    auto = AutoDraftLength()
    auto.record(2, 1.0, draft_seconds=0.5, accepted=torch.tensor([0]))
    auto.record(1, 1.0)  # a plain step: 1 token per second
    confident = torch.full((1, 4), 0.9)
    assert auto.num_to_verify(confident) == 4 and auto.wants_draft()  # expected: 4.1 tokens in 1.5 s
    assert auto.realised_seconds == 0  # the first draft also read the whole prompt: its step is not counted
    for _ in range(3):
        auto.record(5, 1.0, draft_seconds=0.2, accepted=torch.tensor([0]))  # realised: 1 token in 1.2 s
    assert auto.num_to_verify(confident) == 4  # the confidences alone still say that drafting pays ...
    assert [auto.wants_draft() for _ in range(5)] == [False, True, False, False, True]  # ... what it realised does not
    auto.record(5, 1.0, draft_seconds=0.2, accepted=torch.tensor([4]))  # a drafted step that paid off
    assert auto.realised_tokens / auto.realised_seconds > 1.0
    assert all(auto.wants_draft() for _ in range(3))
    batch = AutoDraftLength()  # a batch: tokens per row, as a plain step's rate is
    for width, seconds in ((2, 2.0), (1, 2.0), (1, 2.0)):
        batch.record(width, seconds, draft_seconds=0.5, accepted=torch.tensor([0, 1]))
    assert batch.realised_tokens / batch.realised_seconds == pytest.approx(1.5 / 2.5)


def test_a_slow_step_does_not_stop_drafting_that_pays():
    """The realised rate weighs what the drafted steps committed against their estimated costs, not their measured
    times: one step slowed by something else on the machine must not make drafting look like a loss (which would skip
    the drafter for the next steps), while drafts that are rarely accepted still stop it, whatever their timing."""
    from transformers_dflash.draft_length import AutoDraftLength

    auto = AutoDraftLength()
    auto.record(2, 1.0, draft_seconds=0.2, accepted=torch.tensor([0]))  # the call's first draft
    for _ in range(AutoDraftLength.TRUSTED):
        auto.record(1, 1.0)
        auto.record(3, 1.2, draft_seconds=0.2, accepted=torch.tensor([2]))  # 3 tokens in 1.4 s
    auto.num_to_verify(torch.full((1, 2), 0.9))
    assert auto.wants_draft()
    auto.record(3, 12.0, draft_seconds=0.2, accepted=torch.tensor([2]))  # the same step, timed 10x slower
    assert auto.realised_tokens / auto.realised_seconds == pytest.approx(3 / 1.4, rel=0.1)
    assert all(auto.wants_draft() for _ in range(4))
    for _ in range(6):
        auto.record(3, 1.2, draft_seconds=0.2, accepted=torch.tensor([0]))  # nothing accepted: 1 token in 1.4 s
    assert auto.realised_tokens / auto.realised_seconds < 1.0
    assert not auto.wants_draft()


def test_a_good_copy_skips_the_drafter_that_would_not_beat_it():
    """With a copy expected to have more tokens accepted than the drafter's drafts usually are, the drafter's forward
    would be paid for nothing (the copy heads the block): "auto" skips it. Without a copy, or with a poor one, or
    before it has scored `COMPARED` drafts, the drafter runs. Rows of a batch weigh their gains together."""
    from transformers_dflash.draft_length import AutoDraftLength, FullBlock

    auto = AutoDraftLength()
    auto.record(2, 1.0, draft_seconds=0.1, accepted=torch.tensor([0]))
    auto.record(1, 1.0)
    auto.record(8, 1.5, draft_seconds=0.1, accepted=torch.tensor([1]))
    usual = torch.tensor([[0.8, 0.5, 0.2, 0.1, 0.0, 0.0, 0.0]])  # expected accepted: 0.8 + 0.4 + 0.08 + 0.008 = 1.288
    for _ in range(AutoDraftLength.COMPARED - 1):
        auto.record_drafts(usual)
    assert auto.draft_beats_copies([3.0], 7)  # too few drafts scored to judge
    auto.record_drafts(usual)
    assert auto.draft_expected[-1] == pytest.approx(1.288)
    assert not auto.draft_beats_copies([3.0], 7)  # a copy the drafter never beats
    assert auto.draft_beats_copies([0.0], 7)  # no copy: the drafter's 1.29 tokens for a tenth of a step
    assert auto.draft_beats_copies([0.5], 7)  # a poor copy
    assert auto.draft_beats_copies([3.0, 0.0], 7)  # one row gains enough for both
    assert not auto.draft_beats_copies([3.0, 3.0, 3.0, 0.5], 7)  # one row gains too little for four
    assert FullBlock().draft_beats_copies([3.0], 7)  # only "auto" skips
    auto.start_call()
    assert len(auto.draft_expected) == AutoDraftLength.COMPARED  # carried, like the step costs


def test_auto_starts_each_call_from_what_the_earlier_calls_measured():
    """A new call keeps the last KEPT steps of each width and drafts, but judges afresh whether drafting pays (a new
    text); its first draft (which also reads the prompt) is neither a draft's cost nor a realised rate. Copy rates
    carry over as if from at most CARRIED tries."""
    from transformers_dflash.draft_length import AutoDraftLength
    from transformers_dflash.ngram_lookup import CopyAcceptance

    auto = AutoDraftLength()
    auto.record(2, 1.0, draft_seconds=9.0, accepted=torch.tensor([0]))  # a call's first draft
    for _ in range(AutoDraftLength.KEPT + 5):
        auto.record(1, 1.0)
        auto.record(3, 2.0, draft_seconds=0.5, accepted=torch.tensor([0]))
    auto.num_to_verify(torch.full((1, 4), 0.9))  # the drafter's confidences say that drafting pays ...
    assert not auto.wants_draft()  # ... but it realised 1 token in 2.5 s against 1 in 1 s for plain steps
    auto.start_call()
    assert auto.realised_seconds == 0 and auto.wants_draft()
    assert sorted({w: len(auto.step_times[w]) for w in (1, 2, 3)}.items()) == [
        (1, AutoDraftLength.KEPT),
        (2, 1),
        (3, AutoDraftLength.KEPT),
    ]
    assert len(auto.draft_seconds) == AutoDraftLength.KEPT and auto.first_draft_seconds == 9.0
    assert auto.num_to_verify(torch.full((1, 4), 0.9)) in range(5)  # no exploring: widths 1 and 2 are known
    auto.record(3, 2.0, draft_seconds=7.0, accepted=torch.tensor([2]))  # this call's first draft
    assert auto.first_draft_seconds == 7.0 and auto.draft_seconds[-1] == 0.5 and auto.realised_seconds == 0
    copies = CopyAcceptance(block_size=4)
    for accepted in (1, 1, 1, 0) * 5:
        copies.record(copied=1, accepted=accepted, verified=1)
    rate = copies.rates[0]
    copies.start_call()
    assert copies.tries[0] == CopyAcceptance.CARRIED and copies.hits[0] == pytest.approx(0.75 * CopyAcceptance.CARRIED)
    assert copies.rates[0] > 0.6 and rate > 0.6


@pytest.mark.parametrize("batch", [1, 2])
def test_a_drafter_remembers_auto_per_thread_count_and_batch_size(batch):
    """generate() calls of one drafter share their "auto" policy and copy rates (`drafter.draft_length_memory`), per
    device, thread count and batch size; outputs stay plain generate()'s."""
    from transformers_dflash.ngram_lookup import default_ngram_lookup

    target = make_target("llama", dtype=torch.float32, eos_token_id=None)
    drafter = make_drafter(target, block_size=4)
    prompt = _repetitive_prompt(batch)
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False, pad_token_id=PAD)
    expected = target.generate(prompt, **kwargs)
    key = ("auto", "cpu", torch.get_num_threads(), batch)
    copies = ("copies", default_ngram_lookup("cpu"), 4)  # the copy rates, per lookup size and block size
    assert torch.equal(target.generate(prompt, assistant_model=drafter, **kwargs), expected)
    policy = drafter.draft_length_memory[key]
    steps = sum(map(len, policy.step_times.values()))
    assert steps > 0 and copies in drafter.draft_length_memory
    assert torch.equal(target.generate(prompt, assistant_model=drafter, **kwargs), expected)
    assert drafter.draft_length_memory[key] is policy and sum(map(len, policy.step_times.values())) > steps
    drafter.draft_length = "full"  # other policies keep nothing
    assert torch.equal(target.generate(prompt, assistant_model=drafter, **kwargs), expected)
    assert set(drafter.draft_length_memory) == {key, copies}
    drafter.draft_length_memory.clear()


@pytest.mark.parametrize("batch", [1, 3])
def test_skipped_drafts_keep_the_drafters_context(batch, monkeypatch):
    """When "auto" skips the drafter, the skipped steps' target features still reach its next context: the drafts
    it then proposes equal those of a run that drafted every step (float64, so only rounding could differ)."""
    from transformers_dflash import DFlashCandidateGenerator
    from transformers_dflash.draft_length import ConfidenceThreshold

    target = make_target("qwen3", dtype=torch.float64, eos_token_id=None)
    drafter = make_drafter(target, block_size=4, seed=7)
    prompts = [random_prompt(5 + 4 * i, seed=i)[0] for i in range(batch)]
    width = max(len(p) for p in prompts)
    input_ids = torch.stack([torch.cat([torch.full((width - len(p),), PAD), p]) for p in prompts])
    attention_mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=20, do_sample=False, pad_token_id=PAD)
    expected = target.generate(input_ids, **kwargs)

    original_draft = DFlashCandidateGenerator.draft
    recorded = {}

    def recording_draft(generator, anchor_ids, anchor_position_ids, *args, **kw):
        drafts, confidence = original_draft(generator, anchor_ids, anchor_position_ids, *args, **kw)
        for row, position in enumerate(anchor_position_ids.tolist()):
            recorded[(row, position)] = drafts[row].tolist()
        return drafts, confidence

    monkeypatch.setattr(DFlashCandidateGenerator, "draft", recording_draft)
    drafter.draft_length, drafter.ngram_lookup = 0.0, 0  # a policy that verifies every draft, no copies...
    assert torch.equal(target.generate(input_ids, assistant_model=drafter, **kwargs), expected)
    every_step, recorded = recorded, {}
    calls = iter(range(1000))
    monkeypatch.setattr(ConfidenceThreshold, "wants_draft", lambda self: next(calls) % 3 == 0)  # ...skips 2 of 3
    assert torch.equal(target.generate(input_ids, assistant_model=drafter, **kwargs), expected)
    drafter.draft_length = None
    common = set(recorded) & set(every_step)
    assert len(recorded) >= 3 * batch and len(common) >= 2 * batch  # drafts after skipped steps were compared
    assert all(recorded[key] == every_step[key] for key in common)


def _repetitive_prompt(batch, length=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(3, VOCAB, (batch, 5), generator=g)
    return motif.repeat(1, length // 5 + 1)[:, :length]


@pytest.mark.parametrize("draft_length", ["full", 0.3, "auto"])
@pytest.mark.parametrize("batch", [1, 3])
def test_ngram_lookup_is_lossless_and_accepted(draft_length, batch):
    """Copied drafts (drafter.ngram_lookup) are verified like any other: the output stays plain generate()'s, and
    on a repetitive sequence with an untrained drafter they are what gets accepted."""
    target = make_target("llama", dtype=torch.float32, eos_token_id=None)
    drafter = make_drafter(target, block_size=6)
    prompt = _repetitive_prompt(batch)
    attention_mask = torch.ones_like(prompt)
    attention_mask[1:, :3] = 0  # ragged rows (left padding)
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=30, do_sample=False, pad_token_id=PAD)
    expected = target.generate(prompt, **kwargs)
    drafter.draft_length = draft_length
    accepted = {}
    for lookup in (0, 2):
        drafter.ngram_lookup = lookup
        assert torch.equal(target.generate(prompt, assistant_model=drafter, **kwargs), expected)
        rows = drafter.last_acceptance_lengths if batch > 1 else [drafter.last_acceptance_lengths]
        accepted[lookup] = sum(sum(row) - len(row) for row in rows)  # accepted drafts, all rows
    drafter.ngram_lookup, drafter.draft_length = None, None
    if draft_length != "auto":  # "auto" may rightly decline to verify on a machine where width costs
        assert accepted[2] > accepted[0]


def test_copies_of_each_match_length_keep_their_own_rates():
    """1-gram copies, accepted far less often than 2-gram ones, neither inherit nor drag down their rates."""
    from transformers_dflash.ngram_lookup import CopyAcceptance, NgramLookup

    lookup = NgramLookup(2, block_size=4)
    for _ in range(2 * CopyAcceptance.TRUSTED):
        lookup.copied = [(2, 1), (1, 1)]  # row 0 copied after a 2-gram match, row 1 after a 1-gram one
        lookup.record([1, 0], 1)  # the 2-gram copy accepted, the 1-gram copy rejected
    sequences = torch.tensor([[7, 8, 9, 7, 8], [4, 1, 2, 9, 2]])  # row 0: "7 8" again; row 1: only "2" again
    no_drafts = torch.zeros(2, 0, dtype=torch.long)
    drafts, confidence = lookup.merge(lookup.find(sequences, [0, 1], [5, 5], 1), no_drafts, None, 1)
    assert drafts.tolist() == [[9], [9]] and lookup.copied == [(2, 1), (1, 1)]
    assert confidence[0, 0] > 0.8 and confidence[1, 0] < 0.2


def test_a_confident_drafter_keeps_its_drafts_over_a_poor_copy():
    """A copy heads the block only where it is expected to have more drafts accepted than the drafter's own (the sum
    of cumulative confidences); without the drafter's scores (it did not run, or "full" asks for none) it always does."""
    from transformers_dflash.ngram_lookup import NgramLookup

    lookup = NgramLookup(2, block_size=4)
    sequences = torch.tensor([[5, 6, 7, 5], [5, 6, 7, 5]])  # both rows: the 1-gram "5" again, copy [6, 7, 5]
    drafts = torch.tensor([[11, 12, 13], [21, 22, 23]])
    confidence = torch.tensor([[0.9, 0.9, 0.9], [0.3, 0.1, 0.1]])  # expected 2.44 / 0.33 against the copy's 0.875
    merged, merged_confidence = lookup.merge(lookup.find(sequences, [0, 1], [4, 4], 3), drafts.clone(), confidence, 3)
    assert merged.tolist() == [[11, 12, 13], [6, 7, 5]]
    assert merged_confidence[0].tolist() == pytest.approx([0.9, 0.9, 0.9])
    assert merged_confidence[1].tolist() == pytest.approx([0.5, 0.5, 0.5])
    assert lookup.copied == [(0, 0), (1, 3)]  # only the copy that was proposed is scored afterwards
    merged, _ = lookup.merge(lookup.find(sequences, [0, 1], [4, 4], 3), drafts.clone(), None, 3)
    assert merged.tolist() == [[6, 7, 5], [6, 7, 5]]


def test_ngram_lookup_one_pass_equals_a_scan_per_length():
    """`_continuation` finds every match length in one pass; it must pick what a scan per length (longest first, the
    most recent occurrence of it) picks, including matches near the start and repeats that overlap the suffix."""
    from transformers_dflash.ngram_lookup import NgramLookup

    def scan_per_length(tokens, max_n, num_draft):
        seq = tokens.tolist()
        for n in range(min(max_n, len(seq) - 1), 0, -1):
            ends = [e for e in range(n - 1, len(seq) - 1) if seq[e - n + 1 : e + 1] == seq[-n:]]
            if ends:
                return n, seq[ends[-1] + 1 : ends[-1] + 1 + num_draft]
        return None

    generator = torch.Generator().manual_seed(0)
    cases = [torch.tensor([7]), torch.tensor([7, 7]), torch.tensor([3, 3, 3, 3, 3]), torch.tensor([1, 2, 1, 2, 1, 2])]
    cases += [torch.randint(0, vocab, (length,), generator=generator) for vocab in (2, 3, 5) for length in (2, 5, 40)]
    for tokens in cases:
        for max_n in (1, 2, 4, 6):
            found = NgramLookup(max_n, block_size=4)._continuation(tokens, 3)
            found = None if found is None else (found[0], found[1].tolist())
            assert found == scan_per_length(tokens, max_n, 3), (tokens.tolist(), max_n)


def test_ngram_lookup_continuation_and_bad_setting():
    from transformers_dflash.ngram_lookup import CopyAcceptance, NgramLookup

    lookup = NgramLookup(2, block_size=4)
    tokens = torch.tensor([5, 6, 7, 8, 5, 6, 9, 5, 6])
    match, copy = lookup._continuation(tokens, 3)
    assert match == 2 and copy.tolist() == [9, 5, 6]  # the most recent earlier "5 6" was followed by 9
    assert lookup._continuation(torch.tensor([1, 2, 3, 4]), 3) is None
    match, copy = lookup._continuation(torch.tensor([4, 1, 2, 9, 2]), 3)
    assert match == 1 and copy.tolist() == [9, 2]  # falls back to the 1-gram "2"
    no_drafts = torch.zeros(1, 0, dtype=torch.long)
    drafts, confidence = lookup.merge(lookup.find(torch.stack([tokens, tokens]), [1], [9, 9], 3), no_drafts, None, 3)
    assert drafts.tolist() == [[9, 5, 6]] and confidence.tolist() == [[0.5, 0.5, 0.5]]
    assert lookup.copied == [(2, 3)]
    lookup.record([1], 3)  # first copy accepted, second rejected
    bigrams = lookup.acceptance[2]
    assert bigrams.hits[:3] == [1, 0, 0] and bigrams.tries[:3] == [1, 1, 0]
    assert lookup.acceptance[1].tries == [0, 0, 0, 0]  # a 2-gram copy says nothing about 1-gram copies
    _, confidence = lookup.merge(lookup.find(torch.stack([tokens, tokens]), [1], [9, 9], 3), no_drafts, None, 3)
    # A depth tried fewer than TRUSTED times is rated no lower than the depth before (one early rejection must not
    # stop its copies from ever being verified again); an untried depth inherits the one before.
    assert confidence[0].tolist() == pytest.approx([2 / 3, 2 / 3, 2 / 3])
    for _ in range(CopyAcceptance.TRUSTED - 1):
        lookup.copied = [(2, 3)]
        lookup.record([1], 3)  # the second copy rejected again: now its measured rate stands
    assert bigrams.rates[1] < bigrams.rates[0] / 2
    # A depth whose copies stop being verified forgets: each time its copy is proposed but not verified, its counts
    # keep FORGET of their weight, so it drifts back to its prior and is tried again (the text may have changed).
    prose = CopyAcceptance(block_size=4)
    for _ in range(10):
        prose.record(3, 0, 3)  # ten first copies rejected
    assert prose.rates[0] < 0.1
    for _ in range(30):
        prose.record(3, 0, 0)  # proposed, not verified (a plain step)
    assert prose.tries[0] < CopyAcceptance.TRUSTED and prose.rates[0] == pytest.approx(0.5)
    loop = NgramLookup(2, block_size=8)
    for _ in range(10):  # a repetition loop: every copy verified so far (depths 0-1) was accepted
        loop.copied = [(2, 2)]
        loop.record([2], 2)
    repeating = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]])
    _, confidence = loop.merge(loop.find(repeating, [0], [11], 7), no_drafts, None, 7)
    assert bool((confidence[0, :3] > 0.9).all())  # copies of depth 0-2 ("3 1 2") look as good as the tried ones,
    assert loop.acceptance[2].rates[6] > 0.9  # and so would deeper ones (a fixed 1/2 prior made depth 6 worth 1/2 ** 7)
    target = make_target("llama", dtype=torch.float32, eos_token_id=None)
    drafter = make_drafter(target)
    drafter.ngram_lookup = 0.5
    with pytest.raises(ValueError, match="ngram_lookup"):
        target.generate(random_prompt(5, seed=0), assistant_model=drafter, max_new_tokens=4)
