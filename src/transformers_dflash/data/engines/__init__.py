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

from .base import (
    DEFAULT_PAD_FRACTION,
    EngineError,
    OnBatch,
    ServerError,
    TokenizerMismatchError,
    generate_in_buckets,
    length_buckets,
    response_ids,
    weights_sha256,
)
from .ctranslate2_engine import CT2_COMPUTE_TYPES, CTranslate2Engine, convert_to_ctranslate2, default_ct2_cache_dir
from .openai_engine import PROBE_PROMPT, PROBE_TEXT, OpenAIEngine
from .transformers_engine import TransformersEngine

ENGINE_NAMES = ("transformers", "ctranslate2", "openai", "answers")

__all__ = [
    "CT2_COMPUTE_TYPES",
    "DEFAULT_PAD_FRACTION",
    "ENGINE_NAMES",
    "PROBE_PROMPT",
    "PROBE_TEXT",
    "CTranslate2Engine",
    "EngineError",
    "OnBatch",
    "OpenAIEngine",
    "ServerError",
    "TokenizerMismatchError",
    "TransformersEngine",
    "convert_to_ctranslate2",
    "default_ct2_cache_dir",
    "generate_in_buckets",
    "length_buckets",
    "response_ids",
    "weights_sha256",
]
