"""Tests of the DFlash training recipe (transformers_dflash.training) on a tiny random Llama target."""

import argparse
import io
import itertools
import json
import math
import shutil
from dataclasses import replace

import pytest
import torch
from torch.nn import functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from transformers_dflash import DFlashCandidateGenerator, DFlashDraftModel
from transformers_dflash.data import DataError, ShardCorruptedError, shard_to_parquet_bytes
from transformers_dflash.training import (
    TrainingConfig,
    add_train_arguments,
    block_position_ids,
    build_block_attention_mask,
    cache_context_features,
    check_cached_features,
    check_replay_features,
    default_gamma,
    dflash_loss,
    evaluate_acceptance_length,
    iter_training_examples,
    loss_weights,
    replay_acceptance,
    run_train,
    sample_anchors,
    target_context_features,
    target_features_and_choices,
    train,
)

BLOCK_SIZE = 4


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread


def tiny_target(dtype=torch.float32, num_layers=4, initializer_range=0.02):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        initializer_range=initializer_range,
    )
    return LlamaForCausalLM(config).to(dtype).eval().requires_grad_(False)  # frozen, as in training


def tiny_drafter(target, num_layers=2, target_layer_ids=(1, 2), std=None):
    torch.manual_seed(1)
    drafter = DFlashDraftModel.from_target(
        target, num_layers=num_layers, block_size=BLOCK_SIZE, target_layer_ids=list(target_layer_ids)
    )
    if std is not None:  # larger weights make attention (and so the mask) matter a lot for the outputs
        for name, param in drafter.named_parameters():
            if "norm" not in name:
                torch.nn.init.normal_(param, std=std)
    return drafter


def write_shards(directory, target, num_examples=16, per_shard=6, prompt_len=8, response_len=32, fmt="pt"):
    """Shards in the agreed format (`fmt`: "pt" lists of tensors or "parquet" as `dflash regenerate` writes them):
    prompts of random tokens, responses regenerated greedily by the target."""
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(2)
    prompts = torch.randint(3, 96, (num_examples, prompt_len), generator=generator)
    with torch.no_grad():
        sequences = target.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=response_len,
            min_new_tokens=response_len,
            do_sample=False,
            pad_token_id=0,
        )
    examples = []
    for i, sequence in enumerate(sequences):
        length = len(sequence) - (i % 3) * 5  # ragged lengths, so batches get padded
        loss_mask = torch.arange(length) >= prompt_len
        examples.append({"input_ids": sequence[:length].clone(), "loss_mask": loss_mask})
    for start in range(0, num_examples, per_shard):
        shard = examples[start : start + per_shard]
        if fmt == "parquet":
            (directory / f"shard-{start // per_shard:05d}.parquet").write_bytes(shard_to_parquet_bytes(shard))
        else:
            torch.save(shard, directory / f"shard-{start // per_shard:05d}.pt")
    return examples


def test_block_attention_mask_hand_checked():
    anchors = torch.tensor([[1, 3]])
    mask = build_block_attention_mask(anchors, seq_len=6, block_size=3)
    expected = torch.tensor(
        [
            # context 0..5       | block 0 | block 1
            [1, 0, 0, 0, 0, 0,     1, 1, 1,  0, 0, 0],  # block 0 (anchor 1) sees context < 1
            [1, 0, 0, 0, 0, 0,     1, 1, 1,  0, 0, 0],
            [1, 0, 0, 0, 0, 0,     1, 1, 1,  0, 0, 0],
            [1, 1, 1, 0, 0, 0,     0, 0, 0,  1, 1, 1],  # block 1 (anchor 3) sees context < 3
            [1, 1, 1, 0, 0, 0,     0, 0, 0,  1, 1, 1],
            [1, 1, 1, 0, 0, 0,     0, 0, 0,  1, 1, 1],
        ],
        dtype=torch.bool,
    )  # fmt: skip
    assert mask.dtype == torch.bool and mask.shape == (1, 1, 6, 12)
    assert torch.equal(mask[0, 0], expected)
    assert block_position_ids(anchors, 3).tolist() == [[1, 2, 3, 3, 4, 5]]


def test_loss_weights():
    weights = loss_weights(16)
    assert weights.shape == (16,)
    assert weights[0] == 0 and weights[1] == 1
    assert torch.allclose(weights[1:], torch.exp(-torch.arange(15.0) / 7))
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7, 5, 4)
    assert math.isclose(loss_weights(10)[3].item(), math.exp(-2 / 5), rel_tol=1e-6)
    assert math.isclose(loss_weights(8)[8 - 1].item(), math.exp(-6 / 4), rel_tol=1e-6)
    assert math.isclose(loss_weights(4, gamma=2.0)[3].item(), math.exp(-1.0), rel_tol=1e-6)
    assert 5 < default_gamma(13) < 7 and default_gamma(32) > 7 and default_gamma(4) == 2


def test_sample_anchors():
    seq_len, block_size = 30, 4
    loss_mask = torch.zeros(3, seq_len, dtype=torch.bool)
    loss_mask[0, 10:] = True
    loss_mask[0, 15:18] = False  # a hole (e.g. a tool output) inside the response
    loss_mask[1, 20:] = True  # candidates 20 .. 26 only
    loss_mask[2, 28:] = True  # no candidate: the block would not fit
    candidates = [set(p for p in range(seq_len - block_size + 1) if loss_mask[r, p]) for r in range(3)]
    generator = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(50):
        anchors, valid = sample_anchors(loss_mask, 10, block_size, generator)
        assert anchors.shape == valid.shape == (3, 10)
        for r in range(3):
            chosen = anchors[r][valid[r]].tolist()
            assert chosen == sorted(chosen) and len(set(chosen)) == len(chosen)
            assert set(chosen) <= candidates[r]
            assert all(a <= seq_len - block_size for a in chosen)
            assert len(chosen) == min(10, len(candidates[r]))
            assert valid[r].tolist() == sorted(valid[r].tolist(), reverse=True)  # padding last
            assert (anchors[r][~valid[r]] == 0).all()
        seen.update(anchors[0][valid[0]].tolist())
    assert seen == candidates[0]  # every candidate gets drawn
    anchors, valid = sample_anchors(loss_mask[1], 100, block_size)  # 1-D input, fewer candidates than asked
    assert anchors.tolist() == list(range(20, 27)) and valid.all()
    anchors, valid = sample_anchors(loss_mask[2], 5, block_size)
    assert anchors.shape == (1,) and not valid.any()


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_packed_blocks_equal_blocks_alone(attn_implementation):
    """Each block of the packed training forward equals that block run alone on its context, as at inference."""
    target = tiny_target(torch.float64)
    drafter = tiny_drafter(target, std=0.3)
    drafter.config._attn_implementation = attn_implementation
    seq_len = 20
    input_ids = torch.randint(3, 96, (2, seq_len), generator=torch.Generator().manual_seed(0))
    anchors = torch.tensor([[2, 5, 11, 16], [4, 7, 8, 9]])
    features = target_context_features(target, input_ids, drafter.config.target_layer_ids)
    block_ids = torch.full((2, 4, BLOCK_SIZE), drafter.config.mask_token_id)
    block_ids[:, :, 0] = input_ids.gather(1, anchors)
    embeddings = target.get_input_embeddings()(block_ids.flatten(1))

    def packed(mask):
        with torch.no_grad():
            return drafter(
                block_embeddings=embeddings,
                context_features=features,
                block_position_ids=block_position_ids(anchors, BLOCK_SIZE),
                context_position_ids=torch.arange(seq_len).expand(2, seq_len),
                attention_mask=mask,
            ).last_hidden_state.view(2, 4, BLOCK_SIZE, -1)

    together = packed(build_block_attention_mask(anchors, seq_len, BLOCK_SIZE))
    everything_visible = packed(None)
    for b in range(2):
        for j, anchor in enumerate(anchors[b].tolist()):
            with torch.no_grad():
                alone = drafter(
                    block_embeddings=embeddings[b : b + 1, j * BLOCK_SIZE : (j + 1) * BLOCK_SIZE],
                    context_features=features[b : b + 1, :anchor],
                    block_position_ids=torch.arange(anchor, anchor + BLOCK_SIZE)[None],
                    context_position_ids=torch.arange(anchor)[None],
                ).last_hidden_state[0]
            torch.testing.assert_close(together[b, j], alone, rtol=1e-5, atol=1e-5)  # eager softmax is float32
            assert (everything_visible[b, j] - alone).abs().max() > 1e-3  # the mask matters in this test


def test_training_features_match_inference_features():
    """Training's features and the decoding hooks' are transformers' hidden_states[i + 1], last layer included, and
    the features pass leaves no hook on the target."""
    target = tiny_target()
    drafter = tiny_drafter(target, target_layer_ids=(0, 2, 3))
    input_ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden_states = target(input_ids, output_hidden_states=True).hidden_states
    expected = torch.cat([hidden_states[i + 1] for i in (0, 2, 3)], dim=-1)
    hooks_before = [len(module._forward_hooks) for module in target.modules()]  # layers and the final norm
    torch.testing.assert_close(target_context_features(target, input_ids, [0, 2, 3]), expected)
    assert [len(module._forward_hooks) for module in target.modules()] == hooks_before
    generator = DFlashCandidateGenerator(drafter, target)
    with torch.no_grad():
        target(input_ids)
    captured = generator.captured_features()
    generator.close()
    torch.testing.assert_close(captured, expected)


def test_dflash_loss_matches_reference_and_offline_features():
    target = tiny_target(torch.float64)
    drafter = tiny_drafter(target, std=0.1)
    seq_len, num_anchors = 24, 5
    input_ids = torch.randint(3, 96, (2, seq_len), generator=torch.Generator().manual_seed(3))
    loss_mask = torch.zeros(2, seq_len, dtype=torch.bool)
    loss_mask[0, 6:] = True
    loss_mask[1, 15:22] = True  # ends before the sequence does: some labels are masked out
    attention_mask = torch.ones(2, seq_len, dtype=torch.long)

    loss, metrics = dflash_loss(
        drafter,
        target,
        input_ids,
        loss_mask,
        num_anchors,
        attention_mask=attention_mask,
        generator=torch.Generator().manual_seed(7),
        labels="text",
    )
    # Offline: precomputed features, same anchors -> same loss.
    features = target_context_features(target, input_ids, drafter.config.target_layer_ids)
    offline, _ = dflash_loss(
        drafter,
        target,
        input_ids,
        loss_mask,
        num_anchors,
        context_features=features,
        generator=torch.Generator().manual_seed(7),
        labels="text",
    )
    torch.testing.assert_close(loss, offline)

    # Reference: every block alone on its context, plain weighted cross-entropy.
    anchors, valid = sample_anchors(loss_mask, num_anchors, BLOCK_SIZE, torch.Generator().manual_seed(7))
    weights = loss_weights(BLOCK_SIZE).double()
    total, total_weight, correct, labelled, accepted = 0.0, 0.0, 0, 0, []
    for b in range(2):
        for anchor in anchors[b][valid[b]].tolist():
            block = torch.tensor([input_ids[b, anchor].item()] + [drafter.config.mask_token_id] * (BLOCK_SIZE - 1))
            with torch.no_grad():
                hidden = drafter(
                    block_embeddings=target.get_input_embeddings()(block)[None],
                    context_features=features[b : b + 1, :anchor],
                    block_position_ids=torch.arange(anchor, anchor + BLOCK_SIZE)[None],
                    context_position_ids=torch.arange(anchor)[None],
                ).last_hidden_state[0]
            logits = target.lm_head(hidden)
            prefix, run = 0, True
            for k in range(1, BLOCK_SIZE):
                is_labelled = bool(loss_mask[b, anchor + k])
                hit = is_labelled and logits[k].argmax().item() == input_ids[b, anchor + k].item()
                run = run and hit
                prefix += run
                if is_labelled:
                    total += weights[k] * F.cross_entropy(logits[k], input_ids[b, anchor + k])
                    total_weight += weights[k]
                    correct += hit
                    labelled += 1
            accepted.append(prefix)
    torch.testing.assert_close(loss.detach(), total / total_weight)
    assert metrics["num_labels"].item() == labelled and metrics["num_blocks"].item() == len(accepted)
    assert math.isclose(metrics["accuracy"].item(), correct / labelled, rel_tol=1e-6)
    assert math.isclose(metrics["acceptance_length"].item(), 1 + sum(accepted) / len(accepted), rel_tol=1e-6)
    assert metrics["slot_accuracy"].shape == (BLOCK_SIZE - 1,)

    loss.backward()  # gradients reach every drafter weight
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters())


def test_target_choices_are_the_targets_greedy_next_tokens():
    target = tiny_target(torch.float64)
    input_ids = torch.randint(3, 96, (2, 11), generator=torch.Generator().manual_seed(4))
    features, choices, top = target_features_and_choices(target, input_ids, [1, 2], chunk=4)  # chunks: 4 + 4 + 2
    assert top is None
    torch.testing.assert_close(features, target_context_features(target, input_ids, [1, 2]))
    expected = target(input_ids).logits.argmax(-1)
    assert torch.equal(choices[:, 1:], expected[:, :-1]) and torch.equal(choices[:, 0], input_ids[:, 0])


def _target_path_text(target, seq_len, leave_at):
    """A sequence the target writes greedily, with the text forced off the target's path at `leave_at`."""
    ids = torch.tensor([[5, 17, 33]])
    while ids.shape[1] < seq_len:
        nxt = target(ids).logits[:, -1].argmax(-1, keepdim=True)
        if ids.shape[1] in leave_at:
            nxt = (nxt + 1) % 96
        ids = torch.cat([ids, nxt], dim=1)
    return ids


def test_target_labels_follow_the_verifier_and_mask_off_path_slots():
    target = tiny_target(torch.float64, initializer_range=0.2)
    drafter = tiny_drafter(target, std=0.1)
    seq_len, num_anchors = 20, 6
    input_ids = _target_path_text(target, seq_len, leave_at={9, 14})
    loss_mask = torch.zeros(1, seq_len, dtype=torch.bool)
    loss_mask[0, 3:] = True
    _, target_ids, _ = target_features_and_choices(target, input_ids, drafter.config.target_layer_ids)
    off_path = (target_ids != input_ids)[0, 3:].nonzero().flatten() + 3
    assert off_path.tolist() == [9, 14]  # the response leaves the target's greedy path there

    def run(labels, ids=None):
        return dflash_loss(
            drafter,
            target,
            input_ids,
            loss_mask,
            num_anchors,
            generator=torch.Generator().manual_seed(2),
            target_ids=ids,
            labels=labels,
        )

    loss, metrics = run("target")
    auto, _ = run("auto")  # online training: the target's choices are computed, so "auto" is "target"
    cached, _ = run("target", target_ids)
    text, _ = run("text")
    torch.testing.assert_close(loss, auto)
    torch.testing.assert_close(loss, cached)
    assert not torch.allclose(loss, text)

    # Reference: slot k learns target_ids[anchor + k] while the text after the anchor, before slot k, is on the path.
    features = target_context_features(target, input_ids, drafter.config.target_layer_ids)
    anchors, valid = sample_anchors(loss_mask, num_anchors, BLOCK_SIZE, torch.Generator().manual_seed(2))
    weights = loss_weights(BLOCK_SIZE).double()
    total, total_weight, labelled, agreeing = 0.0, 0.0, 0, 0
    for anchor in anchors[0][valid[0]].tolist():
        block = torch.tensor([input_ids[0, anchor].item()] + [drafter.config.mask_token_id] * (BLOCK_SIZE - 1))
        with torch.no_grad():
            hidden = drafter(
                block_embeddings=target.get_input_embeddings()(block)[None],
                context_features=features[:, :anchor],
                block_position_ids=torch.arange(anchor, anchor + BLOCK_SIZE)[None],
                context_position_ids=torch.arange(anchor)[None],
            ).last_hidden_state[0]
        logits = target.lm_head(hidden)
        for k in range(1, BLOCK_SIZE):
            if not all(input_ids[0, anchor + j] == target_ids[0, anchor + j] for j in range(1, k)):
                break
            total += weights[k] * F.cross_entropy(logits[k], target_ids[0, anchor + k])
            total_weight += weights[k]
            labelled += 1
            agreeing += int(input_ids[0, anchor + k] == target_ids[0, anchor + k])
    torch.testing.assert_close(loss.detach(), total / total_weight)
    assert metrics["num_labels"].item() == labelled
    assert math.isclose(metrics["text_agreement"].item(), agreeing / labelled, rel_tol=1e-6) and agreeing < labelled

    # On the target's own greedy text both rules are the same loss.
    input_ids = _target_path_text(target, seq_len, leave_at=set())
    torch.testing.assert_close(run("target")[0], run("text")[0])


def test_target_labels_need_the_targets_choices(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target)
    input_ids = torch.randint(3, 96, (1, 12))
    features = target_context_features(target, input_ids, drafter.config.target_layer_ids)
    with pytest.raises(ValueError, match="needs the target's choices.*--labels text"):
        dflash_loss(
            drafter,
            target,
            input_ids,
            torch.ones(1, 12, dtype=torch.bool),
            2,
            context_features=features,
            labels="target",
        )
    with pytest.raises(ValueError, match="labels='gold'"):
        dflash_loss(drafter, target, input_ids, torch.ones(1, 12, dtype=torch.bool), 2, labels="gold")
    (tmp_path / "features.json").write_text(json.dumps({"target_layer_ids": [1, 2], "max_length": 64}))
    (tmp_path / "shard-00000.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="without the target's choices.*--labels text"):
        check_cached_features(tmp_path, [1, 2], "target")
    check_cached_features(tmp_path, [1, 2], "auto")  # auto falls back to the text
    with pytest.raises(ValueError, match="older `dflash features`.*another --out"):
        cache_context_features(target, tmp_path, tmp_path, [1, 2], max_length=64, progress=False)


def test_evaluate_acceptance_length_leaves_drafter_alone():
    target = tiny_target(torch.float64)
    drafter = tiny_drafter(target).float().train()
    prompts = [torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9)]
    tau = evaluate_acceptance_length(target, drafter, prompts, max_new_tokens=12)
    assert 1 <= tau <= BLOCK_SIZE
    assert next(drafter.parameters()).dtype == torch.float32 and drafter.training  # not moved by generate()


def test_replayed_acceptance_equals_greedy_decoding():
    """The replay over cached features of the target's greedy answers gives, step for step, the acceptance lengths of
    real DFlash decoding with whole blocks: answers that end at EOS and at max_new_tokens, partial and full accepts."""
    from conftest import EOS, make_drafter, make_target

    target = make_target()  # peaky logits: answers loop, so a briefly trained drafter gets drafts accepted
    drafter = make_drafter(target, block_size=BLOCK_SIZE).double()
    prompts = torch.randint(3, 96, (8, 6), generator=torch.Generator().manual_seed(0))
    answers = target.generate(prompts, max_new_tokens=30, do_sample=False)
    loss_mask = torch.zeros_like(answers, dtype=torch.bool)
    loss_mask[:, 6:] = True
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    drafter.train()
    for _ in range(60):
        loss, _ = dflash_loss(drafter, target, answers, loss_mask, 16)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    drafter.eval()
    drafter.draft_length, drafter.ngram_lookup = "full", 0  # whole blocks, no copied drafts: what the replay replays
    examples, decoded = [], []
    for prompt in prompts[:5]:
        answer = target.generate(prompt[None], assistant_model=drafter, max_new_tokens=25, do_sample=False)
        decoded.append(drafter.last_acceptance_lengths[1:])
        features, choices, _ = target_features_and_choices(target, answer, drafter.config.target_layer_ids)
        mask = torch.arange(answer.shape[1]) >= 6
        examples.append(
            {"input_ids": answer[0], "loss_mask": mask, "context_features": features[0], "target_ids": choices[0]}
        )
    assert EOS in [int(e["input_ids"][-1]) for e in examples] and 31 in [len(e["input_ids"]) for e in examples]
    assert any(1 < n < BLOCK_SIZE for lengths in decoded for n in lengths)  # partial accepts
    assert any(n == BLOCK_SIZE for lengths in decoded for n in lengths)  # whole blocks
    replay = replay_acceptance(target, drafter, examples)
    assert replay["acceptance_lengths"] == decoded
    assert replay_acceptance(target, drafter, examples, anchors_per_forward=3) == replay  # blocks in chunks: the same
    steps = [n for lengths in decoded for n in lengths]
    assert replay["tau"] == pytest.approx(sum(steps) / len(steps)) and replay["steps"] == len(steps)
    assert 1 <= replay["tau_all_anchors"] <= BLOCK_SIZE and len(replay["slot_accuracy"]) == BLOCK_SIZE - 1


def test_replay_counts_a_slot_only_while_the_text_follows_the_target(monkeypatch):
    """On text that leaves the target's greedy path, a slot counts only while the text before it is the target's
    choice (the training label rule): a drafter that always drafts the target's choices is accepted up to there."""
    target = tiny_target(torch.float64)
    drafter = tiny_drafter(target).double().eval()
    answer = target.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=12, do_sample=False)[0]
    features, choices, _ = target_features_and_choices(target, answer[None], drafter.config.target_layer_ids)
    text = answer.clone()
    text[9] = (text[9] + 1) % 96  # the text leaves the path at position 9
    example = {
        "input_ids": text,
        "loss_mask": torch.arange(len(text)) >= 4,
        "context_features": features[0],
        "target_ids": choices[0],
    }
    from transformers_dflash import candidate_generator

    original = candidate_generator.DraftHead.__call__

    def perfect(self, hidden):  # a drafter that always drafts the target's choices
        drafts, logits = original(self, hidden)
        anchors = torch.arange(4, len(text) - 1)
        positions = (anchors[:, None] + torch.arange(1, BLOCK_SIZE)).clamp(max=len(text) - 1)
        return choices[0][positions], logits

    monkeypatch.setattr(candidate_generator.DraftHead, "__call__", perfect)
    replay = replay_acceptance(target, drafter, [example])
    # From position 4: blocks at 4 (slots 5..7 on the path: 3 accepted), 8 (slot 9 is labelled, the target's choice
    # there differs from the text, so slot 10 is not: 1 accepted), then 10 and 13 past the deviation.
    assert replay["acceptance_lengths"][0][:2] == [4, 2]
    assert replay["slot_accuracy"][0] == 1.0


def test_replay_features_are_checked(tmp_path):
    with pytest.raises(ValueError, match="no features.json.*dflash regenerate --prompts mtbench"):
        check_replay_features(tmp_path, [1, 2])
    (tmp_path / "features.json").write_text(json.dumps({"target_layer_ids": [1, 2], "max_length": 64}))
    with pytest.raises(ValueError, match="without the target's choices"):
        check_replay_features(tmp_path, [1, 2])
    (tmp_path / "features.json").write_text(json.dumps({"target_layer_ids": [1, 2], "target_choices": True}))
    check_replay_features(tmp_path, [1, 2])
    with pytest.raises(ValueError, match=r"layers \[1, 2\], but the drafter reads layers \[0, 3\]"):
        check_replay_features(tmp_path, [0, 3])
    (tmp_path / "features.json").write_text('{"target_layer_ids": [1, ')  # cut short, e.g. by a full disk
    for check in (check_replay_features, check_cached_features):
        with pytest.raises(ValueError, match="features.json is not valid JSON.*dflash features --out NEW_DIR"):
            check(tmp_path, [1, 2])


def small_config(tmp_path, data, output, **overrides):
    values = dict(
        target="unused",
        data=str(data),
        output=str(output),
        num_layers=1,
        block_size=BLOCK_SIZE,
        num_anchors=8,
        batch_size=2,
        grad_accum=2,
        max_steps=4,
        lr=3e-3,
        save_every=2,
        keep_checkpoints=5,
        eval_every=100,
        num_val_prompts=2,
        val_max_new_tokens=8,
        log_every=1,
        seed=0,
    )
    values.update(overrides)
    return TrainingConfig(**values)


def read_log(output):
    return [json.loads(line) for line in open(output / "log.jsonl")]


def test_checkpoint_resume_is_exact(tmp_path):
    target = tiny_target()
    write_shards(tmp_path / "data", target)
    assert len(list(iter_training_examples(tmp_path / "data"))) == 16

    full = train(small_config(tmp_path, tmp_path / "data", tmp_path / "a"), target=target)
    assert full["step"] == 4 and full["resumed_from"] is None
    assert full["val_acceptance_length"] >= 1
    # An interrupted run: only the step-2 checkpoint exists; training the same config resumes from it.
    (tmp_path / "b").mkdir()
    shutil.copytree(tmp_path / "a" / "checkpoint-00000002", tmp_path / "b" / "checkpoint-00000002")
    resumed = train(small_config(tmp_path, tmp_path / "data", tmp_path / "b"), target=target)
    assert resumed["resumed_from"] == 2 and resumed["step"] == 4
    assert [r["step"] for r in read_log(tmp_path / "b") if "loss" in r] == [3, 4]
    # each record carries this run's training seconds: steps per second between two records, loading left out
    seconds = [r["train_seconds"] for r in read_log(tmp_path / "b") if "loss" in r]
    assert 0 < seconds[0] <= seconds[1]

    final_a = DFlashDraftModel.from_pretrained(tmp_path / "a").state_dict()
    final_b = DFlashDraftModel.from_pretrained(tmp_path / "b").state_dict()
    assert all(torch.equal(final_a[name], final_b[name]) for name in final_a)
    optimizer_a = torch.load(tmp_path / "a" / "checkpoint-00000004" / "optimizer.pt", weights_only=True)
    optimizer_b = torch.load(tmp_path / "b" / "checkpoint-00000004" / "optimizer.pt", weights_only=True)
    for i, state in optimizer_a["state"].items():
        assert all(torch.equal(state[key], optimizer_b["state"][i][key]) for key in state)
    losses_a = {r["step"]: r["loss"] for r in read_log(tmp_path / "a") if "loss" in r}
    losses_b = {r["step"]: r["loss"] for r in read_log(tmp_path / "b") if "loss" in r}
    assert losses_a[3] == losses_b[3] and losses_a[4] == losses_b[4]


def test_auto_mixed_precision_is_bf16_where_bfloat16_is_fast(tmp_path, monkeypatch):
    from transformers_dflash.training import loop

    for fast, expected in ((True, "bf16"), (False, "no")):
        monkeypatch.setattr(loop, "bfloat16_is_fast", lambda device, fast=fast: fast)
        assert loop.autocast_precision("auto") == expected
    assert loop.autocast_precision("no") == "no" and loop.autocast_precision("fp16") == "fp16"
    # both run on a CPU (bf16 autocast works there too); the log says which one trained
    from accelerate.state import AcceleratorState

    target = tiny_target()
    write_shards(tmp_path / "data", target)
    try:
        for fast, expected in ((True, "bf16"), (False, "no")):
            # accelerate keeps one precision per process: reset it (a private accelerate call, tests only)
            AcceleratorState._reset_state(reset_partial_state=True)
            monkeypatch.setattr(loop, "bfloat16_is_fast", lambda device, fast=fast: fast)
            out = tmp_path / expected
            config = small_config(tmp_path, tmp_path / "data", out, max_steps=2, save_every=100)
            summary = train(config, target=target)
            start = read_log(out)[0]
            assert start["config"]["mixed_precision"] == "auto" and start["mixed_precision"] == expected
            assert summary["step"] == 2 and all(math.isfinite(r["loss"]) for r in read_log(out) if "loss" in r)
    finally:  # the next test's train() picks its own precision again
        AcceleratorState._reset_state(reset_partial_state=True)


def test_bfloat16_is_fast_on_cpus_with_amx_or_avx512_bf16(monkeypatch):
    from transformers_dflash.kernels import bfloat16_is_fast

    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    for amx, avx512_bf16 in itertools.product((True, False), repeat=2):
        for check, supported in zip(checks, (amx, avx512_bf16)):
            monkeypatch.setattr(torch.cpu, check, lambda supported=supported: supported, raising=False)
        assert bfloat16_is_fast("cpu") is (amx or avx512_bf16)

    def unreadable():
        raise RuntimeError("cpuinfo failed")

    for check in checks:
        monkeypatch.setattr(torch.cpu, check, unreadable, raising=False)
    assert bfloat16_is_fast("cpu") is False  # the float32 default, slower but safe
    monkeypatch.setattr(torch.cpu, checks[1], lambda: True, raising=False)
    assert bfloat16_is_fast("cpu") is True  # the AMX check failing leaves the AVX512-BF16 check's answer
    for check in checks:
        monkeypatch.delattr(torch.cpu, check, raising=False)
    assert bfloat16_is_fast(torch.device("cpu")) is False and bfloat16_is_fast("meta") is False


def test_training_validates_by_replay_on_held_out_features(tmp_path):
    target = tiny_target()
    write_shards(tmp_path / "data", target)
    write_shards(tmp_path / "heldout", target, num_examples=4, per_shard=4)
    features = tmp_path / "heldout-features"
    cache_context_features(
        target, tmp_path / "heldout", features, [1, 2], max_length=64, dtype=torch.float32, progress=False
    )
    config = small_config(
        tmp_path, tmp_path / "data", tmp_path / "out", target_layer_ids=[1, 2], val_features=str(features), eval_every=2
    )
    summary = train(config, target=target)
    replays = [r for r in read_log(tmp_path / "out") if "val_replay_tau" in r]
    assert [r["step"] for r in replays] == [2, 4]
    assert summary["val_replay_tau"] == replays[-1]["val_replay_tau"] >= 1
    drafter = DFlashDraftModel.from_pretrained(tmp_path / "out")  # the final drafter is the one validated last
    replay = replay_acceptance(target, drafter, iter_training_examples(features))
    assert replay["tau"] == pytest.approx(summary["val_replay_tau"])
    # The regenerated answers themselves (no features) are refused before any step.
    bad = replace(config, output=str(tmp_path / "bad"), val_features=str(tmp_path / "heldout"))
    with pytest.raises(ValueError, match="--val-features .*heldout: no features.json"):
        train(bad, target=target)
    assert not (tmp_path / "bad" / "log.jsonl").exists()


def test_cli_training_lowers_loss(tmp_path):
    target = tiny_target(initializer_range=0.1)  # peakier logits than 0.02: the loss can fall fast
    write_shards(tmp_path / "data", target, num_examples=12)
    target.save_pretrained(tmp_path / "target")
    parser = add_train_arguments(argparse.ArgumentParser())
    args = parser.parse_args(
        [
            "--target",
            str(tmp_path / "target"),
            "--data",
            str(tmp_path / "data"),
            "--output",
            str(tmp_path / "out"),
            "--num-layers",
            "1",
            "--block-size",
            str(BLOCK_SIZE),
            "--num-anchors",
            "16",
            "--max-steps",
            "24",
            "--lr",
            "5e-3",
            "--log-every",
            "1",
            "--save-every",
            "100",
            "--eval-every",
            "100",
            "--num-val-prompts",
            "2",
            "--val-max-new-tokens",
            "16",
            "--target-layer-ids",
            "1",
            "2",
        ]
    )
    summary = run_train(args)
    losses = [r["loss"] for r in read_log(tmp_path / "out") if "loss" in r]
    assert len(losses) == 24
    assert sum(losses[-5:]) / 5 < 0.85 * sum(losses[:5]) / 5
    assert summary["val_acceptance_length"] >= 1
    drafter = DFlashDraftModel.from_pretrained(tmp_path / "out")
    assert drafter.config.target_layer_ids == [1, 2] and drafter.config.block_size == BLOCK_SIZE


def test_parquet_and_pt_shards_train_identically(tmp_path):
    pytest.importorskip("pyarrow")
    target = tiny_target()
    examples = write_shards(tmp_path / "pt", target, num_examples=8, per_shard=3)
    write_shards(tmp_path / "parquet", target, num_examples=8, per_shard=3, fmt="parquet")
    read = list(iter_training_examples(tmp_path / "parquet"))
    assert len(read) == len(examples)
    for a, b in zip(read, examples):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"].bool())
    for fmt in ("pt", "parquet"):
        train(small_config(tmp_path, tmp_path / fmt, tmp_path / f"out-{fmt}", max_steps=2, save_every=100), target)
    a = DFlashDraftModel.from_pretrained(tmp_path / "out-pt").state_dict()
    b = DFlashDraftModel.from_pretrained(tmp_path / "out-parquet").state_dict()
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_several_data_folders_train_as_one_dataset(tmp_path):
    pytest.importorskip("pyarrow")
    target = tiny_target()
    write_shards(tmp_path / "all", target, num_examples=12, per_shard=4)
    # the same examples in two folders: shards 0-1 as they are, shard 2 as the first shard of a parquet folder
    (tmp_path / "a").mkdir()
    for name in ("shard-00000.pt", "shard-00001.pt"):
        shutil.copy(tmp_path / "all" / name, tmp_path / "a" / name)
    (tmp_path / "b").mkdir()
    last = torch.load(tmp_path / "all" / "shard-00002.pt", weights_only=True)
    (tmp_path / "b" / "shard-00000.parquet").write_bytes(shard_to_parquet_bytes(last))
    both = [str(tmp_path / "a"), str(tmp_path / "b")]
    assert len(list(iter_training_examples(both))) == 12
    settings = dict(max_steps=3, save_every=100, draft_vocab_size=40)
    one = train(small_config(tmp_path, tmp_path / "all", tmp_path / "one", **settings), target)
    two = train(replace(small_config(tmp_path, tmp_path / "all", tmp_path / "two", **settings), data=both), target)
    assert one["step"] == two["step"] == 3
    a = DFlashDraftModel.from_pretrained(tmp_path / "one").state_dict()
    b = DFlashDraftModel.from_pretrained(tmp_path / "two").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)  # draft vocabulary included

    # through the command line, and what is refused
    args = add_train_arguments(argparse.ArgumentParser()).parse_args(["--data", *both, "--output", "x"])
    assert args.data == both
    with pytest.raises(ValueError, match="names .*a twice.*count double"):
        train(replace(small_config(tmp_path, tmp_path / "a", tmp_path / "x"), data=[both[0], both[0] + "/."]), target)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="empty holds no shard-XXXXX.parquet or .pt files"):
        train(replace(small_config(tmp_path, tmp_path / "a", tmp_path / "x"), data=[both[0], str(tmp_path / "empty")]))
    assert not (tmp_path / "x").exists() or not list((tmp_path / "x").iterdir())


def test_features_of_parquet_shards_resume(tmp_path, monkeypatch):
    pytest.importorskip("pyarrow")
    target = tiny_target()
    write_shards(tmp_path / "data", target, num_examples=8, per_shard=3, fmt="parquet")
    out = cache_context_features(
        target,
        tmp_path / "data",
        tmp_path / "features",
        [1, 2],
        batch_size=2,
        max_length=64,
        dtype=torch.float32,
        progress=False,
    )
    assert sorted(p.name for p in out.glob("shard-*")) == ["shard-00000.pt", "shard-00001.pt", "shard-00002.pt"]
    first = {p.name: p.read_bytes() for p in out.glob("shard-*")}
    # an interrupted run: shard 1 is missing; the rerun computes only that one
    (out / "shard-00001.pt").unlink()
    rows = []
    decoder = target.get_decoder()
    original = decoder.forward

    def counting_forward(*args, **kwargs):
        rows.append(kwargs["input_ids"].shape[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(decoder, "forward", counting_forward)
    cache_context_features(
        target, tmp_path / "data", out, [1, 2], batch_size=2, max_length=64, dtype=torch.float32, progress=False
    )
    assert sum(rows) == 3
    monkeypatch.undo()
    for name, content in first.items():
        saved = torch.load(out / name, weights_only=True)
        expected = torch.load(io.BytesIO(content), weights_only=True)
        assert all(torch.equal(x["context_features"], y["context_features"]) for x, y in zip(saved, expected))
    offline = list(iter_training_examples(out))
    assert len(offline) == 8 and offline[0]["context_features"].shape[-1] == 2 * target.config.hidden_size
    # the target's own choices ride along with the features
    first = offline[0]
    _, choices, _ = target_features_and_choices(target, first["input_ids"][None], [1, 2])
    assert torch.equal(first["target_ids"], choices[0])
    info = json.loads((out / "features.json").read_text())
    assert info["target_choices"] is True and 0 <= info["target_agreement"] <= 1


def test_a_damaged_features_shard_names_the_features_command(tmp_path):
    target = tiny_target()
    write_shards(tmp_path / "data", target, num_examples=6, per_shard=3)
    out = cache_context_features(target, tmp_path / "data", tmp_path / "features", [1, 2], progress=False)
    (out / "shard-00001.pt").write_bytes((out / "shard-00001.pt").read_bytes()[:100])
    with pytest.raises(ShardCorruptedError, match="shard-00001.pt.*rerun the same `dflash features` command"):
        list(iter_training_examples(out))


def test_features_record_shard_sizes_and_training_trusts_only_unchanged_files(tmp_path, monkeypatch):
    from transformers_dflash.training import features as features_module

    target = tiny_target()
    write_shards(tmp_path / "data", target, num_examples=7, per_shard=4)
    out = cache_context_features(target, tmp_path / "data", tmp_path / "features", [1, 2], progress=False)
    shards = sorted(out.glob("shard-*.pt"))
    loaded = []
    original = features_module.load_shard
    monkeypatch.setattr(features_module, "load_shard", lambda path: loaded.append(path.name) or original(path))
    assert features_module.shard_sizes(out, shards) == [4, 3] and loaded == []  # read from features.json
    records = torch.load(shards[0], weights_only=True)
    torch.save(records[:2], shards[0])  # the file changed after it was recorded: count it again
    assert features_module.shard_sizes(out, shards) == [2, 3] and loaded == ["shard-00000.pt"]


def test_init_drafter_fine_tunes_a_trained_drafter_and_keeps_its_shape(tmp_path):
    target = tiny_target()
    write_shards(tmp_path / "data", target, num_examples=10, per_shard=5)
    first = dict(max_steps=2, save_every=100, draft_vocab_size=64, mask_token_id=3)
    train(small_config(tmp_path, tmp_path / "data", tmp_path / "first", **first), target)
    trained = DFlashDraftModel.from_pretrained(tmp_path / "first")

    # Other data: a drafter trained from scratch on it would get another draft vocabulary; the fine-tuned one keeps
    # the trained drafter's. At lr 0 fine-tuning changes no weight, so every weight came from the trained drafter.
    write_shards(tmp_path / "other", target, num_examples=10, per_shard=5, response_len=24)
    unset = dict(num_layers=None, block_size=None, init_drafter=str(tmp_path / "first"), max_steps=2, lr=0.0)
    summary = train(small_config(tmp_path, tmp_path / "other", tmp_path / "tuned", **unset), target)
    assert summary["step"] == 2 and summary["resumed_from"] is None
    tuned = DFlashDraftModel.from_pretrained(tmp_path / "tuned")
    assert tuned.config.num_hidden_layers == 1 and tuned.config.block_size == BLOCK_SIZE
    assert tuned.config.draft_vocab_size == 64 and tuned.config.mask_token_id == 3
    state, trained_state = tuned.state_dict(), trained.state_dict()
    assert state.keys() == trained_state.keys()
    assert all(torch.equal(state[name], trained_state[name]) for name in state)

    # Matching shape options are accepted; contradicting ones are refused with the fix, before any training.
    same = dict(unset, num_layers=1, block_size=BLOCK_SIZE, draft_vocab_size=64, max_steps=1)
    train(small_config(tmp_path, tmp_path / "other", tmp_path / "same", **same), target)
    for option, value in [("num_layers", 2), ("block_size", 8), ("draft_vocab_size", 32), ("mask_token_id", 5)]:
        config = small_config(
            tmp_path, tmp_path / "other", tmp_path / f"bad-{option}", **dict(unset, **{option: value})
        )
        flag = "--" + option.replace("_", "-")
        with pytest.raises(ValueError, match=f"{flag} {value}, but the drafter in .* Leave {flag} out"):
            train(config, target)
        assert not list((tmp_path / f"bad-{option}").glob("checkpoint-*"))
    missing = small_config(tmp_path, tmp_path / "other", tmp_path / "none", init_drafter=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="no drafter there .*leave --init-drafter out"):
        train(missing, target)


def test_init_drafter_for_another_target_is_refused(tmp_path):
    target = tiny_target()
    write_shards(tmp_path / "data", target, num_examples=6, per_shard=6)
    train(small_config(tmp_path, tmp_path / "data", tmp_path / "first", max_steps=1, save_every=100), target)
    other = tiny_target(num_layers=6)
    config = small_config(tmp_path, tmp_path / "data", tmp_path / "tuned", init_drafter=str(tmp_path / "first"))
    with pytest.raises(ValueError, match="trained for a target with 4 layers, but the target has 6"):
        train(config, other)
