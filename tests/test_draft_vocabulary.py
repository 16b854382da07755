"""Reduced draft vocabularies (the drafter proposes from a subset of the target's tokens) and offline features."""

import json

import pytest
import torch
from conftest import VOCAB, make_drafter, make_target, random_prompt
from torch.nn import functional as F

from transformers_dflash import DFlashCandidateGenerator, DFlashDraftModel
from transformers_dflash.training import (
    TrainingConfig,
    cache_context_features,
    check_cached_features,
    dflash_loss,
    draft_vocabulary,
    iter_training_examples,
    sample_anchors,
    target_context_features,
    train,
)

DRAFT_IDS = list(range(3, VOCAB, 3))  # every third token


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread


def reduced_drafter(target, ids=DRAFT_IDS, **kwargs):
    return make_drafter(target, draft_vocab_ids=ids, **kwargs)


def test_reduced_vocabulary_is_lossless_and_drafts_only_its_tokens(monkeypatch):
    target = make_target("qwen3", dtype=torch.float32, eos_token_id=None)
    drafter = reduced_drafter(target, block_size=6)
    assert drafter.config.draft_vocab_size == len(DRAFT_IDS)
    drafted = []
    original = DFlashCandidateGenerator.draft

    def recording(self, *args, **kwargs):
        out, confidence = original(self, *args, **kwargs)
        drafted.extend(out.flatten().tolist())
        return out, confidence

    monkeypatch.setattr(DFlashCandidateGenerator, "draft", recording)
    for seed in range(3):
        prompt = random_prompt(7 + seed, seed=seed)
        expected = target.generate(prompt, max_new_tokens=30, do_sample=False)
        got = target.generate(prompt, max_new_tokens=30, do_sample=False, assistant_model=drafter)
        assert torch.equal(got, expected)
    assert drafted and set(drafted) <= set(DRAFT_IDS)

    # Batched and sampled paths too.
    prompts = random_prompt(9, seed=5, batch=3)
    mask = torch.ones_like(prompts)
    mask[1, :3] = 0
    expected = target.generate(prompts, attention_mask=mask, max_new_tokens=20, do_sample=False)
    got = target.generate(prompts, attention_mask=mask, max_new_tokens=20, do_sample=False, assistant_model=drafter)
    assert torch.equal(got, expected)


def test_reduced_vocabulary_drafts_the_best_token_of_the_subset():
    target = make_target("llama", dtype=torch.float32)
    drafter = reduced_drafter(target, block_size=4)
    generator = DFlashCandidateGenerator(drafter, target)
    with torch.no_grad():
        prompt = random_prompt(8, seed=1)
        target(prompt)
        features = generator.captured_features()
        drafts, _ = generator.draft(prompt[:, -1], torch.tensor([7]), features[:, :7], torch.arange(7)[None])
        # Reference: the full-vocabulary logits, restricted to the subset by hand.
        full = DFlashCandidateGenerator(make_drafter(target, block_size=4), target)
        full.drafter.load_state_dict({k: v for k, v in drafter.state_dict().items() if k != "draft_vocab_ids"})
        target(prompt)
        hidden = full.drafter(
            block_embeddings=target.get_input_embeddings()(
                torch.tensor([[prompt[0, -1].item()] + [drafter.config.mask_token_id] * 3])
            ),
            context_features=full.captured_features()[:, :7],
            block_position_ids=torch.arange(7, 11)[None],
            context_position_ids=torch.arange(7)[None],
        ).last_hidden_state
    logits = target.lm_head(hidden[:, 1:])[..., DRAFT_IDS]
    expected = torch.tensor(DRAFT_IDS)[logits.argmax(-1)]
    assert torch.equal(drafts, expected)
    generator.close()
    full.close()


def test_reduced_vocabulary_round_trips_and_is_checked(tmp_path):
    target = make_target("llama", dtype=torch.float32)
    drafter = reduced_drafter(target)
    drafter.save_pretrained(tmp_path)
    loaded = DFlashDraftModel.from_pretrained(tmp_path)
    assert torch.equal(loaded.draft_vocab_ids, torch.tensor(DRAFT_IDS))
    assert loaded.config.draft_vocab_size == len(DRAFT_IDS)

    with pytest.raises(ValueError, match="distinct token ids"):
        drafter.set_draft_vocabulary(DRAFT_IDS[:-1])
    with pytest.raises(ValueError, match="must lie in"):
        drafter.set_draft_vocabulary([VOCAB + 5] + DRAFT_IDS[1:])
    with pytest.raises(ValueError, match="whole vocabulary"):
        make_drafter(target).set_draft_vocabulary(DRAFT_IDS)
    with pytest.raises(ValueError, match="draft_vocab_size must be between"):
        make_drafter(target, draft_vocab_size=VOCAB + 1)


def test_loss_with_reduced_vocabulary_matches_restricted_cross_entropy():
    target = make_target("llama", dtype=torch.float64)
    drafter = reduced_drafter(target).double()
    input_ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.zeros(1, 20, dtype=torch.bool)
    loss_mask[0, 5:] = True
    loss, metrics = dflash_loss(
        drafter, target, input_ids, loss_mask, 4, generator=torch.Generator().manual_seed(1), labels="text"
    )

    anchors, valid = sample_anchors(loss_mask, 4, 4, torch.Generator().manual_seed(1))
    features = target_context_features(target, input_ids, drafter.config.target_layer_ids)
    ids = torch.tensor(DRAFT_IDS)
    weights = torch.exp(-torch.arange(3, dtype=torch.float64) / 2.0)  # default gamma for block 4 is 2
    total, total_weight, correct, labelled = 0.0, 0.0, 0, 0
    for anchor in anchors[0][valid[0]].tolist():
        block = torch.tensor([input_ids[0, anchor].item()] + [drafter.config.mask_token_id] * 3)
        with torch.no_grad():
            hidden = drafter(
                block_embeddings=target.get_input_embeddings()(block)[None],
                context_features=features[:, :anchor],
                block_position_ids=torch.arange(anchor, anchor + 4)[None],
                context_position_ids=torch.arange(anchor)[None],
            ).last_hidden_state[0]
        logits = target.lm_head(hidden)[:, ids]
        for k in range(1, 4):
            label = input_ids[0, anchor + k].item()
            labelled += 1
            correct += ids[logits[k].argmax()].item() == label
            if label in DRAFT_IDS:  # labels outside the subset have no loss
                total += weights[k - 1] * F.cross_entropy(logits[k], torch.tensor(DRAFT_IDS.index(label)))
                total_weight += weights[k - 1]
    torch.testing.assert_close(loss.detach(), total / total_weight)
    assert metrics["num_labels"].item() == labelled
    assert abs(metrics["accuracy"].item() - correct / labelled) < 1e-9


def test_draft_vocabulary_takes_the_most_frequent_response_tokens(tmp_path):
    examples = [
        {
            "input_ids": torch.tensor([50, 50, 50, 7, 7, 9, 9, 9]),
            "loss_mask": torch.tensor([0, 0, 0, 1, 1, 1, 1, 1]).bool(),
        },
        {"input_ids": torch.tensor([11, 11, 7, 12]), "loss_mask": torch.tensor([0, 1, 1, 1]).bool()},
    ]
    torch.save(examples, tmp_path / "shard-00000.pt")
    # Response counts: 9 -> 3, 7 -> 3, 11 -> 1, 12 -> 1; prompt-only token 50 does not count.
    assert draft_vocabulary(tmp_path, 2, VOCAB).tolist() == [7, 9]
    assert draft_vocabulary(tmp_path, 3, VOCAB, exclude=[7]).tolist() == [9, 11, 12]
    assert draft_vocabulary(tmp_path, 5, VOCAB).tolist() == [0, 7, 9, 11, 12]  # unseen tokens fill up by id
    with pytest.raises(ValueError, match="does not fit"):
        draft_vocabulary(tmp_path, VOCAB, VOCAB, exclude=[7])


def test_cached_features_train_offline(tmp_path):
    target = make_target("llama", dtype=torch.float32, eos_token_id=None)
    data = tmp_path / "data"
    data.mkdir()
    prompts = torch.randint(3, VOCAB, (12, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        sequences = target.generate(
            prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=20, min_new_tokens=20, do_sample=False
        )
    examples = [
        {"input_ids": s[: 26 - i % 4], "loss_mask": torch.arange(26 - i % 4) >= 6} for i, s in enumerate(sequences)
    ]
    torch.save(examples[:7], data / "shard-00000.pt")
    torch.save(examples[7:], data / "shard-00001.pt")

    layer_ids = [0, 2]
    cached = cache_context_features(
        target, data, tmp_path / "features", layer_ids, batch_size=5, dtype=torch.float32, progress=False
    )
    records = list(iter_training_examples(cached))
    assert len(records) == len(examples)
    for record, example in zip(records, examples):
        assert torch.equal(record["input_ids"], example["input_ids"])
        expected = target_context_features(target, example["input_ids"][None], layer_ids)[0]
        torch.testing.assert_close(record["context_features"], expected, atol=1e-5, rtol=1e-4)
    # Resuming keeps finished shards; other layers are refused.
    cache_context_features(target, data, cached, layer_ids, progress=False)
    with pytest.raises(ValueError, match="holds features of layers"):
        cache_context_features(target, data, cached, [1, 2], progress=False)
    with pytest.raises(ValueError, match="--target-layer-ids 0 2"):
        check_cached_features(cached, [1, 3])

    config = TrainingConfig(
        data=str(cached),
        output=str(tmp_path / "out"),
        num_layers=1,
        block_size=4,
        target_layer_ids=layer_ids,
        draft_vocab_size=40,
        num_anchors=4,
        max_length=64,
        batch_size=2,
        max_steps=4,
        lr=1e-3,
        save_every=100,
        eval_every=100,
        num_val_prompts=2,
        val_max_new_tokens=8,
        log_every=1,
    )
    summary = train(config, target=target)
    assert summary["step"] == 4 and summary["val_acceptance_length"] >= 1.0
    trained = DFlashDraftModel.from_pretrained(tmp_path / "out")
    assert trained.config.draft_vocab_size == 40
    with open(tmp_path / "out" / "log.jsonl") as f:
        assert sum(1 for line in f if "loss" in json.loads(line)) == 4
    # Must not include the mask token (the default mask id is the last row).
    assert VOCAB - 1 not in trained.draft_vocab_ids.tolist()


def test_reduced_vocabulary_exports_to_hub_layout_only(tmp_path):
    from transformers_dflash.interop import check_layout, convert_drafter, export_drafter

    target = make_target("qwen3", dtype=torch.float32)
    drafter = reduced_drafter(target)
    out = export_drafter(drafter, tmp_path / "hub", "hub")
    assert check_layout(out, "hub") == []
    assert torch.equal(convert_drafter(out).draft_vocab_ids, drafter.draft_vocab_ids)
    for layout in ("released", "speculators"):
        with pytest.raises(ValueError, match="reduced vocabulary"):
            export_drafter(drafter, tmp_path / layout, layout)
