"""Generation engines for ``dflash regenerate``: who writes the target's answers to the training prompts.

Every engine has the same small interface, so :func:`transformers_dflash.data.regenerate` does not care which one runs:

* ``generate(prompt_token_ids, max_new_tokens, *, seed=None, on_batch=None) -> list[list[int]]``: for each prompt
  (chat-formatted token ids), the response token ids up to and including the first EOS token, or `max_new_tokens`
  tokens when no EOS came. The results are in the order of the prompts. ``on_batch(prompts, tokens)`` is called as
  work finishes (progress).
* ``prepare()``: checks made before anything is written (the server's model and tokenizer); called once by
  ``regenerate`` (``generate`` calls it too if needed).
* ``settings() -> dict``: what decides the output (recorded in the manifest; resuming with other settings is refused).
* ``runtime() -> dict``: how it ran (batch size, threads, URL: recorded, not checked).

Engines:

* :class:`TransformersEngine`: ``model.generate()`` on batches of prompts of similar length (sorted by length and cut
  so that padding stays small: :func:`length_buckets`); greedy or sampled.
* :class:`CTranslate2Engine`: the target converted to CTranslate2 (``pip install ctranslate2``; converted once and
  cached on disk, keyed by a hash of the weights), greedy, float32 or int8 compute.
* :class:`OpenAIEngine`: an OpenAI-compatible server (vLLM, SGLang, llama.cpp's server, TGI) at a URL, ``/v1/completions``
  with temperature 0, concurrent requests, retries with exponential back-off, and a check that the server's tokenizer is
  the target's (a server with another tokenizer or chat template is refused, not silently mixed).
* :class:`~transformers_dflash.data.answers.AnswersEngine` (``answers.py``): no generation, ShareGPT's own replies laid
  out as responses; a cheap supplement to train on with the target's labels (``--labels target``).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "ENGINE_NAMES",
    "CTranslate2Engine",
    "EngineError",
    "OpenAIEngine",
    "ServerError",
    "TokenizerMismatchError",
    "TransformersEngine",
    "convert_to_ctranslate2",
    "length_buckets",
    "response_ids",
    "weights_sha256",
]

ENGINE_NAMES = ("transformers", "ctranslate2", "openai", "answers")
DEFAULT_PAD_FRACTION = 0.1

OnBatch = Callable[[int, int], None]


class EngineError(RuntimeError):
    """A generation engine failed or is misconfigured; the message says what to do."""


class ServerError(EngineError):
    """An OpenAI-compatible server could not answer (after retries)."""


class TokenizerMismatchError(EngineError):
    """The server tokenizes differently from the target's tokenizer (another model, tokenizer or chat template)."""


# ----------------------------------------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------------------------------------


def response_ids(generated: Sequence[int], eos_ids: Sequence[int], max_new_tokens: int | None = None) -> list[int]:
    """Generated tokens up to and including the first EOS (what follows is padding), at most `max_new_tokens`."""
    generated = list(generated)[:max_new_tokens] if max_new_tokens is not None else list(generated)
    eos = set(eos_ids)
    for i, token in enumerate(generated):
        if token in eos:
            return generated[: i + 1]
    return generated


def length_buckets(
    lengths: Sequence[int], batch_size: int, max_new_tokens: int, pad_fraction: float = DEFAULT_PAD_FRACTION
) -> list[list[int]]:
    """Indices of `lengths` in batches of similar length, longest first.

    Prompts are sorted by length (longest first, ties by index) and cut into batches of at most `batch_size`; a new
    batch also starts when the next prompt would be padded by more than `pad_fraction` of the batch's sequence slot
    (its longest prompt + `max_new_tokens`). So a short prompt is never padded to a long one.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches:
            batch = batches[-1]
            longest = lengths[batch[0]]
            if len(batch) < batch_size and longest - lengths[i] <= pad_fraction * (longest + max_new_tokens):
                batch.append(i)
                continue
        batches.append([i])
    return batches


def generate_in_buckets(
    prompts: list[list[int]],
    generate_batch: Callable[[list[list[int]]], list[list[int]]],
    batch_size: int,
    max_new_tokens: int,
    pad_fraction: float,
    on_batch: OnBatch | None = None,
) -> list[list[int]]:
    """`generate_batch` over the `length_buckets` of `prompts`; the responses in the prompts' order."""
    results: list[list[int] | None] = [None] * len(prompts)
    for batch in length_buckets([len(p) for p in prompts], batch_size, max_new_tokens, pad_fraction):
        outputs = generate_batch([prompts[i] for i in batch])
        for i, out in zip(batch, outputs):
            results[i] = out
        if on_batch is not None:
            on_batch(len(batch), sum(len(o) for o in outputs))
    return results  # type: ignore[return-value]


_VOLATILE_CONFIG_KEYS = {
    "_name_or_path",
    "name_or_path",
    "transformers_version",
    "architectures",
    "_commit_hash",
    "dtype",
    "torch_dtype",
    "_attn_implementation",
    "_attn_implementation_autoset",
    "_attn_implementation_internal",
    "attn_implementation",
    "use_cache",
}


def weights_sha256(model: Any) -> str:
    """SHA-256 of a torch model's state dict (names, dtypes, shapes and bytes) and its config."""
    import torch

    h = hashlib.sha256()
    config = getattr(model, "config", None)
    if config is not None:  # without what saving or loading changes (names, versions; dtypes show in the tensors)
        settings = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
        h.update(json.dumps(settings, sort_keys=True, default=str).encode("utf-8"))
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _model_dtype(model: Any) -> str:
    dtype = getattr(model, "dtype", None)
    return str(dtype).replace("torch.", "") if dtype is not None else "unknown"


# ----------------------------------------------------------------------------------------------------------------------
# transformers
# ----------------------------------------------------------------------------------------------------------------------


class TransformersEngine:
    """``model.generate()`` on length-bucketed, left-padded batches.

    `generation_config` decides greedy or sampling (default: greedy). With sampling, ``generate(..., seed=s)`` seeds
    torch first, so a rerun gives the same responses.
    """

    name = "transformers"

    def __init__(
        self,
        model: Any,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        *,
        batch_size: int = 16,
        pad_fraction: float = DEFAULT_PAD_FRACTION,
        generation_config: Any = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not pad_fraction >= 0:
            raise ValueError(
                f"--pad-fraction {pad_fraction}: use a share of a batch's slot, 0 or more (0.1 on a CPU, 0.5 on a GPU)"
            )
        self.model = model
        self.eos_token_ids = [int(e) for e in eos_token_ids]
        self.pad_token_id = int(pad_token_id)
        self.batch_size = int(batch_size)
        self.pad_fraction = float(pad_fraction)
        self.generation_config = generation_config

    def _config(self, max_new_tokens: int) -> Any:
        import copy

        from transformers import GenerationConfig

        if self.generation_config is not None:
            config = copy.deepcopy(self.generation_config)
        else:
            config = GenerationConfig(do_sample=False, num_beams=1)
        config.max_new_tokens = int(max_new_tokens)
        config.pad_token_id = self.pad_token_id
        config.eos_token_id = self.eos_token_ids or None
        config.return_dict_in_generate = False
        return config

    @property
    def do_sample(self) -> bool:
        return bool(getattr(self.generation_config, "do_sample", False))

    def prepare(self) -> None:
        """Nothing to check: the model is here."""

    def settings(self) -> dict:
        return {"name": self.name, "dtype": _model_dtype(self.model), "do_sample": self.do_sample}

    def runtime(self) -> dict:
        import torch

        return {"batch_size": self.batch_size, "pad_fraction": self.pad_fraction, "threads": torch.get_num_threads()}

    def _generate_batch(self, prompts: list[list[int]], config: Any) -> list[list[int]]:
        import torch

        device = getattr(self.model, "device", None) or next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, ids in enumerate(prompts):
            input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids) :] = 1
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), generation_config=config
            )
        sequences = getattr(out, "sequences", out)
        return [response_ids(row, self.eos_token_ids, config.max_new_tokens) for row in sequences[:, width:].tolist()]

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        seed: int | None = None,
        on_batch: OnBatch | None = None,
    ) -> list[list[int]]:
        import torch

        prompts = [list(p) for p in prompt_token_ids]
        config = self._config(max_new_tokens)
        if self.do_sample and seed is not None:
            torch.manual_seed(seed)
        was_training = getattr(self.model, "training", False)
        self.model.eval()
        try:
            return generate_in_buckets(
                prompts,
                lambda batch: self._generate_batch(batch, config),
                self.batch_size,
                max_new_tokens,
                self.pad_fraction,
                on_batch,
            )
        finally:
            if was_training:
                self.model.train()


# ----------------------------------------------------------------------------------------------------------------------
# CTranslate2
# ----------------------------------------------------------------------------------------------------------------------

CT2_MARKER = "dflash_ct2.json"  # written last: a cache folder without it is incomplete
CT2_COMPUTE_TYPES = ("float32", "int8", "int8_float32", "float16", "bfloat16", "int8_float16", "int8_bfloat16")
CT2_INSTALL = "pip install ctranslate2"


def _import_ctranslate2() -> Any:
    try:
        import ctranslate2
    except ImportError as e:
        raise EngineError(
            f"--engine ctranslate2 needs the ctranslate2 package ({e}). Install it with:\n    {CT2_INSTALL}"
        ) from None
    return ctranslate2


def default_ct2_cache_dir() -> Path:
    """`$DFLASH_CACHE/ctranslate2`, or `~/.cache/transformers_dflash/ctranslate2`."""
    root = os.environ.get("DFLASH_CACHE")
    root = Path(root).expanduser() if root else Path.home() / ".cache" / "transformers_dflash"
    return root / "ctranslate2"


def _tokenizer_sha256(tokenizer: Any) -> str:
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8")).hexdigest()


def convert_to_ctranslate2(model: Any, tokenizer: Any, cache_dir: str | os.PathLike | None = None) -> tuple[Path, str]:
    """The CTranslate2 copy of a transformers causal LM, converted once and cached: ``(folder, key)``.

    The key hashes the weights, the config, the tokenizer's vocabulary and the ctranslate2 version, so a changed
    model never reuses a stale copy. The weights are converted unquantised (float32); the compute type (int8 etc.) is
    chosen when loading. The copy is built in a temporary folder and renamed into place (an interrupted conversion
    leaves nothing half-written).
    """
    ctranslate2 = _import_ctranslate2()
    from ctranslate2.converters import TransformersConverter

    key_hash = hashlib.sha256()
    for part in (weights_sha256(model), _tokenizer_sha256(tokenizer), ctranslate2.__version__):
        key_hash.update(part.encode("utf-8"))
    key = key_hash.hexdigest()
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_ct2_cache_dir()
    folder = root / key[:20]
    if (folder / CT2_MARKER).is_file():
        return folder, key
    root.mkdir(parents=True, exist_ok=True)
    logger.info("converting the target to CTranslate2 in %s (once)", folder)
    work = Path(tempfile.mkdtemp(prefix=".ct2-tmp-", dir=root))
    try:
        hf_dir, out_dir = work / "hf", work / "ct2"
        model.save_pretrained(hf_dir, safe_serialization=True)
        tokenizer.save_pretrained(hf_dir)
        TransformersConverter(str(hf_dir)).convert(str(out_dir), force=True)
        _fill_missing_special_tokens(out_dir / "config.json", tokenizer)
        (out_dir / CT2_MARKER).write_text(json.dumps({"key": key, "ctranslate2": ctranslate2.__version__}) + "\n")
        try:
            os.replace(out_dir, folder)
        except OSError:
            if not (folder / CT2_MARKER).is_file():  # not another process finishing the same conversion first
                shutil.rmtree(folder, ignore_errors=True)
                os.replace(out_dir, folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return folder, key


def _fill_missing_special_tokens(config_path: Path, tokenizer: Any) -> None:
    """CTranslate2 refuses a model whose config has no BOS/EOS/UNK token string (a tokenizer without a BOS token, e.g.
    Qwen's): fill the gaps with a token that exists. Prompts are passed whole, so these are never generated from."""
    config = json.loads(config_path.read_text(encoding="utf-8"))
    fallback = tokenizer.eos_token or tokenizer.convert_ids_to_tokens(0)
    for key in ("bos_token", "eos_token", "unk_token"):
        if config.get(key) is None:
            config[key] = fallback
    config_path.write_text(json.dumps(config, indent=2), encoding="utf-8")


def _check_ct2_vocabulary(folder: Path, tokenizer: Any) -> list[str]:
    """The token strings of ids 0..V-1, after checking that the converted vocabulary maps them back to the same ids
    (CTranslate2 takes token strings, so a duplicate or missing string would silently change the prompt)."""
    path = folder / "vocabulary.json"
    if not path.is_file():
        raise EngineError(f"{folder} is not a CTranslate2 model folder (no vocabulary.json). Delete it to reconvert.")
    vocab = json.loads(path.read_text(encoding="utf-8"))
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(vocab))))
    if tokens[: len(vocab)] != vocab[: len(tokens)] or len(set(vocab)) != len(vocab):
        raise EngineError(
            f"The CTranslate2 vocabulary in {folder} does not map one-to-one onto the tokenizer's ids, "
            "so prompts cannot be passed exactly. Delete the folder to reconvert, or use another engine."
        )
    return tokens


class CTranslate2Engine:
    """Greedy generation with a CTranslate2 ``Generator`` (CPU by default).

    Build it with :meth:`from_transformers` (converts and caches the model). Prompts go in as token strings (the
    tokenizer's own strings for the ids, checked to map back one-to-one), length-bucketed like
    :class:`TransformersEngine`; generation stops at any of the target's EOS ids or after `max_new_tokens` tokens.
    """

    name = "ctranslate2"

    def __init__(
        self,
        model_dir: str | os.PathLike,
        tokenizer: Any,
        eos_token_ids: Sequence[int],
        *,
        compute_type: str = "int8",
        batch_size: int = 32,
        threads: int | None = None,
        device: str = "cpu",
        model_key: str | None = None,
        pad_fraction: float = DEFAULT_PAD_FRACTION,
    ) -> None:
        ctranslate2 = _import_ctranslate2()
        if compute_type not in CT2_COMPUTE_TYPES:
            raise ValueError(f"compute_type must be one of {', '.join(CT2_COMPUTE_TYPES)}; got {compute_type!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not eos_token_ids:
            raise EngineError("the CTranslate2 engine needs the target's EOS token id(s) to know where answers end")
        self.model_dir = Path(model_dir)
        self.tokens = _check_ct2_vocabulary(self.model_dir, tokenizer)
        self.eos_token_ids = [int(e) for e in eos_token_ids]
        self.compute_type = compute_type
        self.batch_size = int(batch_size)
        self.threads = threads
        self.device = device
        self.model_key = model_key
        self.pad_fraction = float(pad_fraction)
        kwargs = {"intra_threads": int(threads)} if threads else {}
        self.generator = ctranslate2.Generator(
            str(self.model_dir), device=device, compute_type=compute_type, inter_threads=1, **kwargs
        )

    @classmethod
    def from_transformers(
        cls,
        model: Any,
        tokenizer: Any,
        eos_token_ids: Sequence[int],
        *,
        cache_dir: str | os.PathLike | None = None,
        **kwargs: Any,
    ) -> CTranslate2Engine:
        folder, key = convert_to_ctranslate2(model, tokenizer, cache_dir)
        return cls(folder, tokenizer, eos_token_ids, model_key=key, **kwargs)

    def prepare(self) -> None:
        """Nothing to check: the vocabulary was checked when the model was loaded."""

    def settings(self) -> dict:
        return {
            "name": self.name,
            "compute_type": self.compute_type,
            "device": self.device,
            "model_sha256": self.model_key,
            "ctranslate2": _import_ctranslate2().__version__,
        }

    def runtime(self) -> dict:
        return {"batch_size": self.batch_size, "threads": self.threads, "model_dir": str(self.model_dir)}

    def _generate_batch(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        try:
            start_tokens = [[self.tokens[t] for t in ids] for ids in prompts]
        except IndexError:
            raise EngineError("a prompt holds a token id outside the CTranslate2 model's vocabulary") from None
        results = self.generator.generate_batch(
            start_tokens,
            max_length=int(max_new_tokens),
            sampling_topk=1,
            beam_size=1,
            end_token=self.eos_token_ids,
            return_end_token=True,
            include_prompt_in_result=False,
            max_batch_size=len(prompts),
        )
        return [response_ids(r.sequences_ids[0], self.eos_token_ids, max_new_tokens) for r in results]

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        seed: int | None = None,
        on_batch: OnBatch | None = None,
    ) -> list[list[int]]:
        return generate_in_buckets(
            [list(p) for p in prompt_token_ids],
            lambda batch: self._generate_batch(batch, max_new_tokens),
            self.batch_size,
            max_new_tokens,
            self.pad_fraction,
            on_batch,
        )


# ----------------------------------------------------------------------------------------------------------------------
# OpenAI-compatible server
# ----------------------------------------------------------------------------------------------------------------------

# Mixed text that different tokenizers split differently: accents, CJK, emoji, code, digits, runs of spaces.
PROBE_TEXT = (
    "Héllo wörld! Ünïcode 你好, naïve café 🙂.\n```python\ndef f(x):\n    return x ** 2  # 12345\n```\n"
    "  Tabs\tand   spaces; URLs https://example.org/a?b=1 & <tags>."
)
PROBE_PROMPT = "Say hello in three languages."
RETRY_STATUS = (408, 409, 425, 429, 500, 502, 503, 504)
_TOKEN_ID_STRING = re.compile(r"^token_id:(\d+)$")


class _HTTPFailure(Exception):
    def __init__(self, message: str, retry: bool) -> None:
        super().__init__(message)
        self.retry = retry


class OpenAIEngine:
    """Greedy completions from an OpenAI-compatible server (``POST {url}/v1/completions``, temperature 0).

    * Prompts are sent as token ids (``prompt_format="ids"``, default: exactly our chat-formatted prompt) or as the
      chat-formatted text (``"text"``, for servers that take only strings, e.g. TGI).
    * Response token ids come from the server when it returns them (vLLM ``return_token_ids`` -> ``token_ids``; vLLM
      ``return_tokens_as_token_ids`` logprob strings; llama.cpp ``return_tokens`` -> ``tokens``); otherwise the text is
      re-tokenized with the target's tokenizer (logged, and recorded in the manifest as ``response_ids: "text"``).
    * `concurrency` requests in flight (servers batch them); each request is retried `max_retries` times on connection
      errors, timeouts and HTTP 408/429/5xx, waiting `backoff` * 2**k seconds (at most `max_backoff`); then a
      :class:`ServerError` says what failed and how to fix it.
    * :meth:`check_server` (run before the first generation) refuses a server whose tokenizer differs from the
      target's: it compares the server's ``/tokenize`` result (when it has one) and the prompt token count it reports
      for probe texts with ours, and every response's reported prompt token count with ours.
    """

    name = "openai"

    def __init__(
        self,
        url: str,
        tokenizer: Any,
        eos_token_ids: Sequence[int],
        *,
        model: str | None = None,
        concurrency: int = 8,
        max_retries: int = 5,
        backoff: float = 1.0,
        max_backoff: float = 30.0,
        timeout: float = 600.0,
        prompt_format: str = "ids",
        chat_probe_ids: Sequence[int] | None = None,
        chat_probe_messages: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if prompt_format not in ("ids", "text"):
            raise ValueError(f"prompt_format must be 'ids' or 'text', got {prompt_format!r}")
        if concurrency < 1 or max_retries < 0:
            raise ValueError("concurrency must be >= 1 and max_retries >= 0")
        url = url.rstrip("/")
        if url.endswith("/v1"):
            url = url[:-3]
        if not re.match(r"^https?://", url):
            raise ValueError(f"server URL must start with http:// or https://, got {url!r}")
        self.url = url
        self.tokenizer = tokenizer
        self.eos_token_ids = [int(e) for e in eos_token_ids]
        self.model = model
        self.concurrency = int(concurrency)
        self.max_retries = int(max_retries)
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.timeout = float(timeout)
        self.prompt_format = prompt_format
        self.chat_probe_ids = list(chat_probe_ids) if chat_probe_ids is not None else None
        self.chat_probe_messages = chat_probe_messages
        self.chat_template_kwargs = chat_template_kwargs
        self.sleep = sleep
        self.response_ids_source: str | None = None
        self.logprob_ids = False  # ask for `logprobs: 1` to read token ids from them (llama.cpp); set by check_server
        self.checked = False
        self._lock = threading.Lock()

    # -- settings ------------------------------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Find the served model (if not named) and check the server's tokenizer, once."""
        if not self.checked:
            self.check_server()

    def settings(self) -> dict:
        return {"name": self.name, "model": self.model, "prompt_format": self.prompt_format, "temperature": 0.0}

    def runtime(self) -> dict:
        return {
            "url": self.url,
            "concurrency": self.concurrency,
            "max_retries": self.max_retries,
            "response_ids": self.response_ids_source,
        }

    # -- HTTP ----------------------------------------------------------------------------------------------------------

    def _request_once(self, method: str, path: str, body: dict | None) -> dict:
        data = json.dumps(body).encode("utf-8") if body is not None else None
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        api_key = os.environ.get("OPENAI_API_KEY")
        if api_key:
            request.add_header("Authorization", f"Bearer {api_key}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                text = response.read().decode("utf-8")
        except urllib.error.HTTPError as e:
            detail = e.read().decode("utf-8", "replace")[:300] if e.fp is not None else ""
            raise _HTTPFailure(f"HTTP {e.code} {e.reason}: {detail}".strip(), e.code in RETRY_STATUS) from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            raise _HTTPFailure(f"{type(e).__name__}: {getattr(e, 'reason', e)}", True) from None
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise _HTTPFailure(f"the answer is not JSON: {text[:200]!r}", True) from None

    def _request(self, method: str, path: str, body: dict | None = None, *, retries: int | None = None) -> dict:
        retries = self.max_retries if retries is None else retries
        for attempt in range(retries + 1):
            try:
                return self._request_once(method, path, body)
            except _HTTPFailure as failure:
                if not failure.retry or attempt == retries:
                    raise ServerError(self._failure_message(method, path, attempt + 1, str(failure))) from None
                wait = min(self.max_backoff, self.backoff * 2**attempt)
                logger.warning(
                    "%s %s%s failed (%s); retry %d/%d in %.1f s",
                    method,
                    self.url,
                    path,
                    failure,
                    attempt + 1,
                    retries,
                    wait,
                )
                self.sleep(wait)
        raise AssertionError("unreachable")

    def _failure_message(self, method: str, path: str, attempts: int, error: str) -> str:
        return (
            f"The OpenAI-compatible server at {self.url} failed: {method} {path} did not succeed after {attempts} "
            f"attempt(s); last error: {error}. Fix: check that the server is running and reachable (e.g. `curl "
            f"{self.url}/v1/models`), that --server-model names a model it serves, and that it is not overloaded "
            "(lower --concurrency, raise --request-timeout or --max-retries); then rerun the same command."
        )

    # -- model and tokenizer check -------------------------------------------------------------------------------------

    def _served_model(self) -> str:
        models = [m.get("id") for m in self._request("GET", "/v1/models").get("data", []) if isinstance(m, dict)]
        models = [m for m in models if m]
        if len(models) != 1:
            raise EngineError(
                f"The server at {self.url} serves {len(models)} models ({', '.join(models) or 'none'}); "
                "name the target's with --server-model."
            )
        return models[0]

    def _server_tokenize(self, text: str) -> list[int] | None:
        """The server's token ids for `text` from its /tokenize endpoint (vLLM, SGLang, llama.cpp), or None."""
        body = {"model": self.model, "prompt": text, "content": text, "add_special_tokens": False, "add_special": False}
        try:
            answer = self._request_once("POST", "/tokenize", body)
        except _HTTPFailure:
            return None
        tokens = answer.get("tokens")
        if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
            return tokens
        return None

    def _server_chat_tokenize(self, messages: list[dict]) -> list[int] | None:
        """The server's chat-formatted token ids for `messages` (vLLM's /tokenize with messages), or None. No tokens
        for a conversation mean the server read no messages (llama.cpp's /tokenize takes `content` only): None."""
        body = {"model": self.model, "messages": messages, "add_generation_prompt": True, "add_special_tokens": False}
        if self.chat_template_kwargs:
            body["chat_template_kwargs"] = self.chat_template_kwargs
        try:
            answer = self._request_once("POST", "/tokenize", body)
        except _HTTPFailure:
            return None
        tokens = answer.get("tokens")
        if isinstance(tokens, list) and tokens and all(isinstance(t, int) for t in tokens):
            return tokens
        return None

    def _server_prompt_count(self, text: str) -> tuple[int | None, list[int] | None, dict]:
        """(prompt token count the server reports for `text`, its prompt token ids if it returns them, the choice)."""
        answer = self._request("POST", "/v1/completions", self._completion_body(text, 1))
        usage = answer.get("usage") or {}
        count = usage.get("prompt_tokens")
        choice = (answer.get("choices") or [{}])[0]
        ids = answer.get("prompt_token_ids") or choice.get("prompt_token_ids")
        return (count if isinstance(count, int) else None), (ids if isinstance(ids, list) else None), choice

    def check_server(self) -> None:
        """Refuse a server whose tokenizer (or chat template, seen through the formatted probe) differs from ours."""
        if self.model is None:
            self.model = self._served_model()
        probes = [PROBE_TEXT]
        if self.chat_probe_ids is not None:
            probes.append(self.tokenizer.decode(self.chat_probe_ids, skip_special_tokens=False))
        compared = 0
        probe_choices = []
        for text in probes:
            ours = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            theirs = self._server_tokenize(text)
            if theirs is not None:
                compared += 1
                if theirs != ours:
                    raise self._mismatch(
                        text,
                        f"its /tokenize gives {len(theirs)} tokens {theirs[:12]}..., the "
                        f"target's tokenizer {len(ours)} tokens {ours[:12]}...",
                    )
            count, ids, choice = self._server_prompt_count(text)
            probe_choices.append(choice)
            if ids is not None:
                compared += 1
                if list(ids) != ours:
                    raise self._mismatch(
                        text, f"it read the probe as {len(ids)} tokens, the target's tokenizer as {len(ours)}"
                    )
            if count is not None:
                compared += 1
                if count != len(ours):
                    raise self._mismatch(text, f"it counts {count} prompt tokens, the target's tokenizer {len(ours)}")
        if self.chat_probe_messages is not None and self.chat_probe_ids is not None:
            theirs = self._server_chat_tokenize(self.chat_probe_messages)
            if theirs is not None and theirs != self.chat_probe_ids:
                raise TokenizerMismatchError(
                    f"The server at {self.url} (model {self.model!r}) formats chats differently from the target: its "
                    f"chat template turns the probe conversation into {len(theirs)} tokens, the target's into "
                    f"{len(self.chat_probe_ids)} ({self.tokenizer.decode(theirs[:24])!r}... vs "
                    f"{self.tokenizer.decode(self.chat_probe_ids[:24])!r}...). It probably serves another model or "
                    "revision; its answers would not be the target's, so they are refused. Fix: serve the target "
                    "itself (with its own chat template), or pass the server's template with --chat-template if it "
                    "is the one the target should answer in."
                )
        if not compared:
            raise TokenizerMismatchError(
                f"The server at {self.url} reports neither /tokenize results nor usage.prompt_tokens, so it cannot be "
                "checked that it uses the target's tokenizer. Use a server that reports them (vLLM, SGLang, "
                "llama.cpp's server and TGI do)."
            )
        self._find_token_ids(probe_choices[0])
        self.checked = True

    def _find_token_ids(self, probe_choice: dict) -> None:
        """Servers that return no token ids with the completion (`probe_choice`, the answer to the first probe) may
        still name them in its log-probabilities (llama.cpp's OpenAI endpoint): ask for those once more, and keep
        asking if they come back, so that responses keep their exact ids rather than a re-tokenization of their
        text."""
        if self._names_token_ids(probe_choice):
            return
        self.logprob_ids = True
        answer = self._request("POST", "/v1/completions", self._completion_body(PROBE_TEXT, 2))
        self.logprob_ids = self._names_token_ids((answer.get("choices") or [{}])[0])
        # False: text only; generate() re-tokenizes it and says so

    def _names_token_ids(self, choice) -> bool:
        has_answer = isinstance(choice, dict) and (choice.get("text") is not None or choice.get("logprobs"))
        return bool(has_answer) and self._choice_token_ids(choice)[1] != "text"

    def _mismatch(self, text: str, detail: str) -> TokenizerMismatchError:
        return TokenizerMismatchError(
            f"The server at {self.url} (model {self.model!r}) does not tokenize like the target: on the probe "
            f"{text[:60]!r}... {detail}. Its answers would not be the target's, so they are refused. Fix: serve the "
            "target model itself with its own tokenizer and chat template (e.g. `vllm serve TARGET_DIR`), or run "
            "`dflash regenerate` with --tokenizer pointing at the tokenizer the server uses."
        )

    # -- completions ---------------------------------------------------------------------------------------------------

    def _completion_body(self, prompt: list[int] | str, max_tokens: int) -> dict:
        return {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": int(max_tokens),
            "temperature": 0.0,
            "top_p": 1.0,
            "n": 1,
            "stream": False,
            "seed": 0,
            # Extensions that make servers hand back exact token ids and stop at the target's EOS ids (ignored by
            # servers that do not know them):
            "return_token_ids": True,
            "return_tokens": True,
            "stop_token_ids": self.eos_token_ids,
            "skip_special_tokens": False,
            "add_special_tokens": False,
            **({"logprobs": 1} if self.logprob_ids else {}),
        }

    def _choice_token_ids(self, choice: dict) -> tuple[list[int], str]:
        ids = choice.get("token_ids")
        if isinstance(ids, list) and all(isinstance(t, int) for t in ids):
            return ids, "token_ids"
        ids = choice.get("tokens")
        if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
            return ids, "tokens"
        strings = (choice.get("logprobs") or {}).get("tokens")
        if (
            isinstance(strings, list)
            and strings
            and all(isinstance(s, str) and _TOKEN_ID_STRING.match(s) for s in strings)
        ):
            return [int(_TOKEN_ID_STRING.match(s).group(1)) for s in strings], "token_id_strings"
        entries = (choice.get("logprobs") or {}).get("content")  # llama.cpp: one {"id", "token", ...} per token
        if (
            isinstance(entries, list)
            and (entries or self.logprob_ids)  # asked for: an empty list is an answer that is only the stop token
            and all(isinstance(e, dict) and type(e.get("id")) is int for e in entries)
        ):
            return [e["id"] for e in entries], "logprob_ids"
        text = choice.get("text")
        if not isinstance(text, str):
            raise ServerError(
                f"The server at {self.url} answered a completion without text or token ids: {json.dumps(choice)[:200]}"
            )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]), "text"

    def _complete(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        if self.prompt_format == "ids":
            prompt: list[int] | str = prompt_ids
        else:
            prompt = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
            if list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"]) != prompt_ids:
                raise EngineError(
                    f"The prompt {prompt[:60]!r}... does not come back as the same tokens after decoding "
                    "and re-encoding with the target's tokenizer, so it cannot be sent as text exactly. "
                    "Use --server-prompt-format ids (a server that takes token ids: vLLM, SGLang, "
                    "llama.cpp)."
                )
        answer = self._request("POST", "/v1/completions", self._completion_body(prompt, max_new_tokens))
        count = (answer.get("usage") or {}).get("prompt_tokens")
        if isinstance(count, int) and count != len(prompt_ids):
            raise self._mismatch(
                str(prompt)[:60], f"it counted {count} prompt tokens where the target has {len(prompt_ids)}"
            )
        choices = answer.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise ServerError(f"The server at {self.url} answered without choices: {json.dumps(answer)[:200]}")
        ids, source = self._choice_token_ids(choices[0])
        self._note_source(source)
        ids = response_ids(ids, self.eos_token_ids, max_new_tokens)
        stopped = choices[0].get("finish_reason") == "stop"
        if (
            stopped
            and (not ids or ids[-1] not in self.eos_token_ids)
            and len(ids) < max_new_tokens
            and self.eos_token_ids
        ):
            ids.append(self.eos_token_ids[0])  # the server stopped at EOS but left the token out
        if not ids:
            raise ServerError(
                f"The server at {self.url} returned an empty completion (finish_reason "
                f"{choices[0].get('finish_reason')!r}); it should end at EOS or run to max_tokens."
            )
        return ids

    def _note_source(self, source: str) -> None:
        with self._lock:
            if self.response_ids_source is None:
                self.response_ids_source = source
                if source == "text":
                    logger.warning(
                        "the server at %s returns no token ids: responses are re-tokenized from text with "
                        "the target's tokenizer (for exact ids use vLLM, or llama.cpp's server)",
                        self.url,
                    )
            elif self.response_ids_source != source:
                self.response_ids_source = "mixed"

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        seed: int | None = None,
        on_batch: OnBatch | None = None,
    ) -> list[list[int]]:
        self.prepare()
        prompts = [list(p) for p in prompt_token_ids]
        results: list[list[int] | None] = [None] * len(prompts)
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="dflash-openai")
        try:
            futures = {pool.submit(self._complete, ids, max_new_tokens): i for i, ids in enumerate(prompts)}
            for future in concurrent.futures.as_completed(futures):
                out = future.result()  # the first failure stops the shard (finished shards are on disk)
                results[futures[future]] = out
                if on_batch is not None:
                    on_batch(1, len(out))
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        return results  # type: ignore[return-value]
