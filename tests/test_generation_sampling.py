"""Sampling with a DFlash drafter must be distributed exactly as the target's own sampling.

A tiny-vocabulary target lets us compute the exact distribution of the first three sampled tokens (after temperature
and top-k); thousands of independent DFlash samples (one batch, one row each) are compared with it by a chi-square
test whose power against a slightly biased sampler is checked too.
"""

import math

import pytest
import torch
from conftest import make_drafter, make_target
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

from transformers_dflash import DFlashCandidateGenerator

VOCAB, NEW, SAMPLES, TEMPERATURE, TOP_K = 6, 3, 4000, 0.8, 4


@torch.no_grad()
def _exact_distribution(target, prompt):
    warpers = LogitsProcessorList([TemperatureLogitsWarper(TEMPERATURE), TopKLogitsWarper(TOP_K)])
    probs = {}

    def walk(prefix, p):
        if len(prefix) == prompt.shape[1] + NEW:
            probs[tuple(prefix[prompt.shape[1] :])] = p
            return
        ids = torch.tensor([prefix])
        logits = target(ids).logits[:, -1].float()
        step = torch.softmax(warpers(ids, logits), dim=-1)[0]
        for token in range(VOCAB):
            if step[token] > 0:
                walk(prefix + [token], p * float(step[token]))

    walk(prompt[0].tolist(), 1.0)
    return probs


def _chi_square(counts, probs, n):
    """Pearson statistic over cells with expected count >= 5 (the rest pooled), and its degrees of freedom."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for cell, p in probs.items():
        expected, observed = n * p, counts.get(cell, 0)
        if expected >= 5:
            stat += (observed - expected) ** 2 / expected
            cells += 1
        else:
            pooled_obs, pooled_exp = pooled_obs + observed, pooled_exp + expected
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-9)
        cells += 1
    outside = sum(v for k, v in counts.items() if k not in probs)  # samples the target can never produce
    return stat, cells - 1, outside


def _critical_value(df, z=3.29):  # Wilson-Hilferty, alpha ~ 5e-4
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.fixture(scope="module")
def setup():
    target = make_target("llama", dtype=torch.float32, vocab_size=VOCAB, eos_token_id=None, seed=3)
    with torch.no_grad():  # a sharper distribution than random init, so proposals are often right and often wrong
        target.lm_head.weight.mul_(2.0)
    prompt = torch.tensor([[1, 4, 3]])
    return target, prompt, _exact_distribution(target, prompt)


def _sample_counts(target, prompt, **kwargs):
    torch.manual_seed(0)
    out = target.generate(
        prompt.repeat(SAMPLES, 1),
        do_sample=True,
        temperature=TEMPERATURE,
        top_k=TOP_K,
        max_new_tokens=NEW,
        pad_token_id=0,
        **kwargs,
    )
    counts = {}
    for row in out[:, prompt.shape[1] :].tolist():
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    return counts


@pytest.mark.parametrize("proposals", ["untrained", "mode", "fixed"])
def test_sampling_matches_target_distribution(setup, proposals, monkeypatch):
    target, prompt, probs = setup
    drafter = make_drafter(target, block_size=4)
    if proposals != "untrained":
        drafter.draft_length, drafter.ngram_lookup = "full", 0  # every proposal below is verified
        original = DFlashCandidateGenerator.draft

        def draft(self, anchor_ids, anchor_position_ids, *args, **kwargs):
            drafts, confidence = original(self, anchor_ids, anchor_position_ids, *args, **kwargs)
            if proposals == "fixed":
                return torch.full_like(drafts, 2), confidence
            # the target's most likely continuation given the anchor: accepted often, rejected often
            ids = torch.cat([prompt.repeat(anchor_ids.shape[0], 1), anchor_ids[:, None]], dim=1)
            for k in range(drafts.shape[1]):
                drafts[:, k] = target(ids).logits[:, -1].argmax(-1)
                ids = torch.cat([ids, drafts[:, k : k + 1]], dim=1)
            return drafts, confidence

        monkeypatch.setattr(DFlashCandidateGenerator, "draft", draft)
    counts = _sample_counts(target, prompt, assistant_model=drafter)
    stat, df, outside = _chi_square(counts, probs, SAMPLES)
    assert outside == 0, "DFlash sampled a sequence the target gives probability 0"
    assert stat < _critical_value(df), f"chi2={stat:.1f} over {df} df: DFlash sampling is not the target's"
    accepted = [n for row in drafter.last_acceptance_lengths for n in row[1:]]
    assert sum(row_sum for row_sum in map(sum, drafter.last_acceptance_lengths)) == SAMPLES * NEW
    if proposals == "mode":
        assert max(accepted) > 1  # drafts really were accepted


def test_the_bound_rejects_a_slightly_biased_sampler(setup):
    """Power check: a sampler that moves 5% of the mass to sequences of always-accepted drafts fails the same bound."""
    _, _, probs = setup
    biased = {cell: 0.95 * p for cell, p in probs.items()}
    repeated = [cell for cell in probs if len(set(cell)) == 1]  # what accepting a fixed proposal would produce
    for cell in repeated:
        biased[cell] += 0.05 / len(repeated)
    expected_stat = SAMPLES * sum((biased[c] - p) ** 2 / p for c, p in probs.items() if SAMPLES * p >= 5)
    df = sum(1 for p in probs.values() if SAMPLES * p >= 5)
    assert expected_stat > 2 * _critical_value(df), expected_stat


def test_plain_sampling_passes_the_same_test(setup):
    target, prompt, probs = setup
    stat, df, outside = _chi_square(_sample_counts(target, prompt), probs, SAMPLES)
    assert outside == 0 and stat < _critical_value(df)
