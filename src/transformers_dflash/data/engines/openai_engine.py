"""The OpenAI-compatible server engine of `dflash regenerate` (vLLM, SGLang, llama.cpp's server, TGI): concurrent
completions with retries and back-off, after a check that the server tokenizes as the target does."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from .base import EngineError, OnBatch, ServerError, TokenizerMismatchError, response_ids

logger = logging.getLogger(__name__)

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
