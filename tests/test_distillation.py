"""Distillation: the target's top tokens cached by `dflash features --top-k`, and the KL term of `dflash train
--kl-weight`."""

import errno
import json

import pytest
import torch
from test_training import read_log, small_config, tiny_drafter, tiny_target, write_shards

from transformers_dflash import DFlashDraftModel
from transformers_dflash.training import (
    cache_context_features,
    check_cached_features,
    dflash_loss,
    target_features_and_choices,
    train,
)
from transformers_dflash.training.features import final_logits


def test_top_tokens_are_the_targets_distribution():
    target = tiny_target(torch.float64)
    input_ids = torch.randint(3, 96, (2, 11), generator=torch.Generator().manual_seed(4))
    _, choices, (top_ids, top_logprobs) = target_features_and_choices(target, input_ids, [1, 2], chunk=4, top_k=5)
    expected = target(input_ids).logits.log_softmax(-1).topk(5, dim=-1)
    assert torch.equal(top_ids[:, 1:], expected.indices[:, :-1])
    torch.testing.assert_close(top_logprobs[:, 1:], expected.values[:, :-1].float())
    assert torch.equal(top_ids[:, 1:, 0], choices[:, 1:])  # the first of them is the greedy choice
    assert not top_ids[:, 0].any() and not top_logprobs[:, 0].any()  # nothing predicts position 0
    _, no_choices, top = target_features_and_choices(target, input_ids, [1, 2], choices=False, top_k=3)
    assert no_choices is None and top[0].shape == (2, 11, 3)


def _family(name):
    import transformers

    small = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    if name == "gemma2":
        config = transformers.Gemma2Config(**small, final_logit_softcapping=2.0, query_pre_attn_scalar=16)
        return transformers.Gemma2ForCausalLM(config)
    if name == "cohere":
        return transformers.CohereForCausalLM(transformers.CohereConfig(**small, logit_scale=0.25))
    return transformers.GraniteForCausalLM(transformers.GraniteConfig(**small, logits_scaling=4.0))


@pytest.mark.parametrize("name", ["gemma2", "cohere", "granite"])
def test_final_logits_apply_the_families_scale_and_softcap(name):
    torch.manual_seed(0)
    target = _family(name).eval()
    input_ids = torch.randint(3, 96, (1, 7))
    with torch.no_grad():
        hidden = target.get_decoder()(input_ids=input_ids).last_hidden_state
        head = target.get_output_embeddings()(hidden)
        logits = target(input_ids).logits
    assert not torch.allclose(head, logits)  # the family changes the head's output
    torch.testing.assert_close(final_logits(target, head), logits)


def _loss(drafter, target, input_ids, loss_mask, **kwargs):
    return dflash_loss(drafter, target, input_ids, loss_mask, 6, generator=torch.Generator().manual_seed(2), **kwargs)


@pytest.mark.parametrize("draft_vocab", [False, True])
def test_kl_to_a_one_hot_teacher_is_the_cross_entropy(draft_vocab):
    """With the target's choice as its only top token (probability 1), KL(target || drafter) is the cross-entropy on
    the hard labels: the same slots, the same weights, the same tokens outside the draft vocabulary dropped."""
    target = tiny_target(torch.float64, initializer_range=0.2)
    if draft_vocab:  # a draft vocabulary that leaves out some of the labels
        torch.manual_seed(1)
        drafter = DFlashDraftModel.from_target(
            target, num_layers=2, block_size=8, target_layer_ids=[1, 2], draft_vocab_size=57
        )
        drafter.set_draft_vocabulary(torch.arange(3, 60))
    else:
        drafter = tiny_drafter(target, std=0.1)
    drafter = drafter.double()
    input_ids = torch.randint(3, 96, (2, 20), generator=torch.Generator().manual_seed(5))
    loss_mask = torch.zeros(2, 20, dtype=torch.bool)
    loss_mask[:, 4:] = True
    features, target_ids, _ = target_features_and_choices(target, input_ids, drafter.config.target_layer_ids)
    one_hot = {"target_top_ids": target_ids[..., None], "target_top_logprobs": torch.zeros(2, 20, 1)}
    hard, _ = _loss(drafter, target, input_ids, loss_mask, context_features=features, target_ids=target_ids)
    kl, metrics = _loss(
        drafter,
        target,
        input_ids,
        loss_mask,
        context_features=features,
        target_ids=target_ids,
        kl_weight=1.0,
        **one_hot,
    )
    torch.testing.assert_close(kl, hard)
    torch.testing.assert_close(metrics["kl"], hard.detach())


def test_kl_online_equals_cached_and_trains_the_drafter():
    target = tiny_target(torch.float64, initializer_range=0.2)
    drafter = tiny_drafter(target, std=0.1).double()
    input_ids = torch.randint(3, 96, (2, 20), generator=torch.Generator().manual_seed(6))
    loss_mask = torch.ones(2, 20, dtype=torch.bool)
    loss_mask[:, :3] = False
    features, target_ids, (top_ids, top_logprobs) = target_features_and_choices(
        target, input_ids, drafter.config.target_layer_ids, top_k=16
    )
    online, online_metrics = _loss(drafter, target, input_ids, loss_mask, kl_weight=0.5)  # the target runs here
    cached, _ = _loss(
        drafter,
        target,
        input_ids,
        loss_mask,
        context_features=features,
        target_ids=target_ids,
        target_top_ids=top_ids,
        target_top_logprobs=top_logprobs,
        kl_weight=0.5,
    )
    hard, hard_metrics = _loss(drafter, target, input_ids, loss_mask)
    torch.testing.assert_close(online, cached)
    torch.testing.assert_close(online, 0.5 * hard + 0.5 * online_metrics["kl"])
    assert online_metrics["kl"] > 0 and "kl" not in hard_metrics
    online.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters())


def test_kl_needs_the_targets_top_tokens(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target)
    input_ids = torch.randint(3, 96, (1, 12))
    loss_mask = torch.ones(1, 12, dtype=torch.bool)
    features, target_ids, _ = target_features_and_choices(target, input_ids, drafter.config.target_layer_ids)
    with pytest.raises(ValueError, match="top tokens.*--top-k 16.*--kl-weight 0"):
        _loss(drafter, target, input_ids, loss_mask, context_features=features, target_ids=target_ids, kl_weight=0.3)
    with pytest.raises(ValueError, match="kl_weight=1.5: use a share between 0"):
        _loss(drafter, target, input_ids, loss_mask, kl_weight=1.5)
    (tmp_path / "features.json").write_text(json.dumps({"target_layer_ids": [1, 2], "target_choices": True}))
    with pytest.raises(ValueError, match="without the target's top tokens.*--top-k 16"):
        check_cached_features(tmp_path, [1, 2], "auto", kl_weight=0.3)
    check_cached_features(tmp_path, [1, 2], "auto")


def test_features_with_top_tokens_train_with_kl_and_resume_only_alike(tmp_path):
    target = tiny_target()
    examples = write_shards(tmp_path / "data", target, num_examples=8, per_shard=4)
    out = cache_context_features(
        target, tmp_path / "data", tmp_path / "features", [1, 2], batch_size=3, dtype=torch.float32, progress=False,
        top_k=4,
    )  # fmt: skip
    records = torch.load(out / "shard-00000.pt", weights_only=True)
    _, choices, (top_ids, top_logprobs) = target_features_and_choices(
        target, examples[0]["input_ids"][None], [1, 2], top_k=4
    )
    assert records[0]["target_top_ids"].dtype == torch.int32 and records[0]["target_top_logprobs"].shape[-1] == 4
    assert torch.equal(records[0]["target_top_ids"].long(), top_ids[0])
    torch.testing.assert_close(records[0]["target_top_logprobs"].float(), top_logprobs[0], atol=2e-3, rtol=1e-3)
    assert json.loads((out / "features.json").read_text())["target_top_k"] == 4
    with pytest.raises(ValueError, match="top 4 tokens.*--top-k 0.*Resume with --top-k 4"):
        cache_context_features(target, tmp_path / "data", out, [1, 2], dtype=torch.float32, progress=False, top_k=0)
    # Left unset, a resume keeps the folder's own top_k rather than refusing the default's.
    cache_context_features(target, tmp_path / "data", out, [1, 2], dtype=torch.float32, progress=False)
    assert json.loads((out / "features.json").read_text())["target_top_k"] == 4

    config = small_config(
        tmp_path, out, tmp_path / "run", max_steps=2, save_every=100, kl_weight=0.5, target_layer_ids=[1, 2]
    )
    train(config, target)
    logged = [r for r in read_log(tmp_path / "run") if "loss" in r]
    assert logged and all(r["kl"] > 0 for r in logged)


def test_features_leave_out_examples_without_a_response_token(tmp_path):
    target = tiny_target()
    write_shards(tmp_path / "data", target, num_examples=6, per_shard=6, prompt_len=8, response_len=16)
    records = torch.load(tmp_path / "data" / "shard-00000.pt", weights_only=True)
    records[2]["loss_mask"][:] = False
    records[2]["loss_mask"][-1] = True  # its only response token lies past max_length
    torch.save(records, tmp_path / "data" / "shard-00000.pt")
    out = cache_context_features(
        target, tmp_path / "data", tmp_path / "features", [1, 2], max_length=10, progress=False
    )
    kept = torch.load(out / "shard-00000.pt", weights_only=True)
    assert len(kept) == 5 and all(r["loss_mask"].any() for r in kept)
    assert json.loads((out / "features.json").read_text())["skipped_no_response"] == 1


def test_features_stop_on_a_full_disk_and_keep_finished_shards(tmp_path, monkeypatch):
    from transformers_dflash.data import DiskFullError, shards
    from transformers_dflash.training import features as features_module

    target = tiny_target()
    write_shards(tmp_path / "data", target, num_examples=8, per_shard=4)
    out = tmp_path / "features"
    real_usage, real_replace = features_module.shutil.disk_usage, shards.os.replace
    free = {"bytes": 10**12}
    monkeypatch.setattr(
        features_module.shutil, "disk_usage", lambda path: real_usage(path)._replace(free=free["bytes"])
    )

    def replace(src, dst):  # the disk fills up while the second shard is written
        if str(dst).endswith("shard-00001.pt"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(shards.os, "replace", replace)
    with pytest.raises(DiskFullError, match=r"Disk full while writing features shard .*shard-00001.pt.*1 shard.*rerun"):
        cache_context_features(target, tmp_path / "data", out, [1, 2], progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["features.json", "shard-00000.pt"]  # no .tmp left behind

    # Short of space before a shard: refused before the target's pass, with what it needs
    monkeypatch.setattr(shards.os, "replace", real_replace)
    free["bytes"] = 1000
    with pytest.raises(DiskFullError, match=r"shard-00001.pt needs about 0.00 GB and .* has 0.00 GB free"):
        cache_context_features(target, tmp_path / "data", out, [1, 2], progress=False)
    free["bytes"] = 10**12
    cache_context_features(target, tmp_path / "data", out, [1, 2], progress=False)
    assert len(torch.load(out / "shard-00001.pt", weights_only=True)) == 4


def test_features_report_a_full_disk_as_an_error_of_the_command(tmp_path, monkeypatch, capsys):
    from transformers_dflash.cli import main
    from transformers_dflash.training import features as features_module

    target = tiny_target()
    write_shards(tmp_path / "data", target, num_examples=4, per_shard=4)
    monkeypatch.setattr("transformers_dflash.training.arguments.load_target", lambda name, dtype: target)
    real_usage = features_module.shutil.disk_usage
    monkeypatch.setattr(features_module.shutil, "disk_usage", lambda path: real_usage(path)._replace(free=0))
    argv = ["features", "--target", "tiny", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "features")]
    argv += ["--target-layer-ids", "1", "2"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "dflash features: error: [Errno 28] shard-00000.pt needs about" in err and "Traceback" not in err


def test_features_command_without_progress_bar(tmp_path, monkeypatch, capsys):
    from transformers_dflash.cli import main

    target = tiny_target()
    write_shards(tmp_path / "data", target, num_examples=4, per_shard=4)
    monkeypatch.setattr("transformers_dflash.training.arguments.load_target", lambda name, dtype: target)
    argv = ["features", "--target", "tiny", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "features")]
    argv += ["--target-layer-ids", "1", "2", "--no-progress"]
    assert main(argv) == 0
    assert (tmp_path / "features" / "shard-00000.pt").is_file()
    assert "features:" not in capsys.readouterr().err  # tqdm's bar, drawn on stderr, is off


def test_features_follow_a_regeneration_until_it_is_complete(tmp_path, monkeypatch):
    from transformers_dflash.training import features as features_module

    target = tiny_target()
    write_shards(tmp_path / "all", target, num_examples=8, per_shard=4)
    data = tmp_path / "data"
    data.mkdir()
    (tmp_path / "all" / "shard-00000.pt").rename(data / "shard-00000.pt")
    manifest = {"format": "dflash-regenerated", "num_shards": 2, "complete": False}
    (data / "manifest.json").write_text(json.dumps(manifest))
    waits = []

    def sleep(seconds):  # the regeneration writes its last shard, then marks itself complete
        waits.append(seconds)
        assert (tmp_path / "features" / "shard-00000.pt").exists()
        (tmp_path / "all" / "shard-00001.pt").rename(data / "shard-00001.pt")
        (data / "manifest.json").write_text(json.dumps(manifest | {"complete": True}))

    monkeypatch.setattr(features_module.time, "sleep", sleep)
    out = cache_context_features(
        target, data, tmp_path / "features", [1, 2], progress=False, follow=True, poll_seconds=5
    )
    assert waits == [5]
    assert [len(torch.load(out / f"shard-0000{i}.pt", weights_only=True)) for i in (0, 1)] == [4, 4]
    # finished: a rerun has nothing to wait for
    assert cache_context_features(target, data, out, [1, 2], progress=False, follow=True) == out and waits == [5]
    with pytest.raises(ValueError, match="--follow waits .* no manifest.json of a regeneration"):
        cache_context_features(target, tmp_path / "all", tmp_path / "f2", [1, 2], progress=False, follow=True)


def test_defaults_distil_where_the_top_tokens_are_at_hand_and_say_so_where_not(tmp_path, capsys):
    from transformers_dflash.training.arguments import add_features_arguments, add_train_arguments
    from transformers_dflash.training.features import DEFAULT_TOP_K
    from transformers_dflash.training.loop import DEFAULT_KL_WEIGHT

    target = tiny_target()
    write_shards(tmp_path / "data", target, num_examples=8, per_shard=4)
    cached = {"dtype": torch.float32, "progress": False}
    with_top = cache_context_features(target, tmp_path / "data", tmp_path / "with-top", [1, 2], **cached)
    without_top = cache_context_features(target, tmp_path / "data", tmp_path / "without", [1, 2], top_k=0, **cached)
    assert json.loads((with_top / "features.json").read_text())["target_top_k"] == DEFAULT_TOP_K
    assert torch.load(with_top / "shard-00000.pt", weights_only=True)[0]["target_top_ids"].shape[-1] == DEFAULT_TOP_K

    def trained(data, name, **overrides):
        train(small_config(tmp_path, data, tmp_path / name, max_steps=2, target_layer_ids=[1, 2], **overrides), target)
        records = read_log(tmp_path / name)
        return next(r for r in records if r.get("event") == "start")["config"]["kl_weight"], records

    weight, records = trained(with_top, "features-with-top")  # offline, the cached top tokens
    assert weight == DEFAULT_KL_WEIGHT and all(r["kl"] > 0 for r in records if "loss" in r)
    weight, records = trained(tmp_path / "data", "online")  # the target computes them itself
    assert weight == DEFAULT_KL_WEIGHT and all(r["kl"] > 0 for r in records if "loss" in r)
    capsys.readouterr()
    weight, records = trained(without_top, "features-without-top")  # older features: hard labels, and a note
    assert weight == 0.0 and not any("kl" in r for r in records)
    assert "without the target's top tokens" in capsys.readouterr().out
    weight, records = trained(with_top, "asked-for-none", kl_weight=0.0)
    assert weight == 0.0 and not any("kl" in r for r in records)
    # Shards written by hand in the documented format (features, no features.json): judged by their examples.
    by_hand = tmp_path / "by-hand"
    by_hand.mkdir()
    for shard in sorted(without_top.glob("shard-*.pt")):
        records = [{k: r[k] for k in ("input_ids", "loss_mask", "context_features")} for r in torch.load(shard)]
        torch.save(records, by_hand / shard.name)
    weight, records = trained(by_hand, "by-hand", labels="text")
    assert weight == 0.0 and not any("kl" in r for r in records)

    import argparse

    train_args = add_train_arguments(argparse.ArgumentParser()).parse_args(["--data", "d", "--output", "o"])
    features_args = add_features_arguments(argparse.ArgumentParser()).parse_args(["--data", "d", "--out", "o"])
    assert train_args.kl_weight is None and features_args.top_k is None  # resolved as above
