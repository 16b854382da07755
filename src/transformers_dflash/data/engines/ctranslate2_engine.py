"""The CTranslate2 engine of `dflash regenerate`: the target converted once (cached on disk, keyed by a hash of its
weights) and decoded greedily in float32 or int8."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .base import DEFAULT_PAD_FRACTION, EngineError, OnBatch, generate_in_buckets, response_ids, weights_sha256

logger = logging.getLogger(__name__)

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
