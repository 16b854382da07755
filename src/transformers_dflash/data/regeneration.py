"""`regenerate()`: the target answers the prompts through an engine, writing resumable shards and a manifest."""

from __future__ import annotations

import copy
import hashlib
import io
import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from ..runtime import chat_token_ids
from .errors import DataError, NoChatTemplateError, ResumeMismatchError
from .shards import (
    DEFAULT_SHARD_FORMAT,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    PARQUET_SHARD_NAME,
    SHARD_FORMATS,
    SHARD_NAME,
    _import_pyarrow,
    load_shard,
    read_manifest,
    shard_to_parquet_bytes,
    write_atomically,
)

logger = logging.getLogger(__name__)


def _eos_ids(target: Any, tokenizer: Any) -> list[int]:
    eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _context_limit(target: Any, tokenizer: Any) -> int | None:
    config = getattr(target, "config", None)
    limits = []
    for cfg in (config, getattr(config, "text_config", None)):
        for attr in ("max_position_embeddings", "n_positions", "max_sequence_length"):
            value = getattr(cfg, attr, None) if cfg is not None else None
            if isinstance(value, int) and value > 0:
                limits.append(value)
    tok_max = getattr(tokenizer, "model_max_length", None)
    if isinstance(tok_max, int) and 0 < tok_max < 10_000_000:
        limits.append(tok_max)
    return min(limits) if limits else None


def _generation_config(
    target: Any,
    max_new_tokens: int,
    do_sample: bool,
    temperature: float,
    top_p: float | None,
    top_k: int | None,
    pad_id: int,
    eos_ids: list[int],
) -> Any:
    """The target's own generation config with the regeneration settings applied (one object, no extra kwargs)."""
    from transformers import GenerationConfig

    base = getattr(target, "generation_config", None)
    config = copy.deepcopy(base) if base is not None else GenerationConfig()
    config.max_new_tokens = int(max_new_tokens)
    config.min_new_tokens = None
    config.min_length = 0
    config.do_sample = bool(do_sample)
    config.temperature = float(temperature) if do_sample else None
    config.top_p = top_p if do_sample else None
    config.top_k = top_k if do_sample else None
    config.num_beams = 1
    config.num_return_sequences = 1
    config.pad_token_id = pad_id
    config.eos_token_id = eos_ids or None
    config.return_dict_in_generate = False
    return config


def _settings_sha(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def prompts_sha256(prompts: Sequence[str]) -> str:
    h = hashlib.sha256()
    for p in prompts:
        h.update(p.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()


def _model_name(obj: Any) -> str:
    value = getattr(obj, "name_or_path", None) or getattr(getattr(obj, "config", None), "_name_or_path", None)
    return str(value) if value else type(obj).__name__


def _versions() -> dict:
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__}
    try:
        out["transformers_dflash"] = metadata.version("transformers-dflash")
    except metadata.PackageNotFoundError:
        pass
    return out


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, unit="prompt", desc="regenerate", dynamic_ncols=True)
            except ImportError:
                logger.info("tqdm is not installed: no progress bar (pip install tqdm)")
        self.tokens = 0
        self.start = time.perf_counter()

    def update(self, prompts: int, tokens: int, shard: int) -> None:
        self.tokens += tokens
        if self.bar is not None:
            rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
            self.bar.set_postfix(shard=shard, tok_s=f"{rate:.1f}", refresh=False)
            self.bar.update(prompts)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _check_regenerate_arguments(
    prompts: Sequence[str],
    max_new_tokens: int,
    batch_size: int,
    shard_size: int,
    do_sample: bool,
    temperature: float,
    shard_format: str,
) -> None:
    if isinstance(prompts, str) or not isinstance(prompts, Sequence):
        raise TypeError("prompts must be a sequence of strings")
    if not prompts:
        raise ValueError("no prompts to regenerate")
    bad = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
    if bad:
        raise TypeError(f"prompts must be strings; item {bad[0]} is {type(prompts[bad[0]]).__name__}")
    for name, value in (("max_new_tokens", max_new_tokens), ("batch_size", batch_size), ("shard_size", shard_size)):
        if int(value) < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if do_sample and not temperature > 0:
        raise ValueError("do_sample=True needs temperature > 0")
    if shard_format not in SHARD_FORMATS:
        raise ValueError(f"shard_format must be one of {SHARD_FORMATS}, got {shard_format!r}")
    if shard_format == "parquet":
        _import_pyarrow()


def _existing_shard(out_dir: Path, s: int) -> Path | None:
    """The file of shard `s` in `out_dir`, in whichever format it was written (None if absent)."""
    found = [p for p in (out_dir / PARQUET_SHARD_NAME.format(s), out_dir / SHARD_NAME.format(s)) if p.exists()]
    if len(found) > 1:
        raise DataError(f"{out_dir} holds shard {s} twice ({found[0].name} and {found[1].name}). Delete one of them.")
    return found[0] if found else None


def _engine_matches(recorded: dict | None, current: dict) -> bool:
    """Whether a manifest's engine settings allow resuming with `current` (manifests from before engines existed
    were all written by transformers)."""
    if recorded is None:
        return current.get("name") == "transformers"
    return recorded == current


def _shard_bytes(records: list[dict], prompt_indices: list[int], shard_format: str) -> bytes:
    if shard_format == "parquet":
        return shard_to_parquet_bytes(records, prompt_indices)
    buf = io.BytesIO()
    torch.save(records, buf)
    return buf.getvalue()


def _shard_info(path: Path, records: list[dict], data: bytes, skipped_empty: int, skipped_long: int) -> dict:
    return {
        "file": path.name,
        "examples": len(records),
        "tokens": sum(r["input_ids"].numel() for r in records),
        "response_tokens": sum(int(r["loss_mask"].sum()) for r in records),
        "skipped_empty": skipped_empty,
        "skipped_too_long": skipped_long,
        "sha256": hashlib.sha256(data).hexdigest(),
        "bytes": len(data),
    }


def _check_responses(responses: Any, expected: int, max_new_tokens: int, engine: Any) -> list[list[int]]:
    """The engine's answers, after checking their shape (one non-empty id list per prompt, within the cap)."""
    from .engines import EngineError

    name = getattr(engine, "name", type(engine).__name__)
    if not isinstance(responses, list) or len(responses) != expected:
        raise EngineError(
            f"engine {name} returned {len(responses) if isinstance(responses, list) else responses!r} "
            f"responses for {expected} prompts"
        )
    for r in responses:
        if not isinstance(r, list) or not r or len(r) > max_new_tokens or not all(isinstance(t, int) for t in r):
            raise EngineError(
                f"engine {name} returned a malformed response (expected 1..{max_new_tokens} token ids): {str(r)[:80]}"
            )
    return responses


def default_engine(
    target: Any,
    tokenizer: Any,
    *,
    batch_size: int = 16,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float | None = None,
    top_k: int | None = None,
    max_new_tokens: int = 256,
    pad_fraction: float | None = None,
) -> Any:
    """The transformers engine for `target` with the regeneration settings (greedy unless `do_sample`)."""
    from .engines import DEFAULT_PAD_FRACTION, TransformersEngine

    eos_ids = _eos_ids(target, tokenizer)
    pad_id = _pad_id(tokenizer, eos_ids)
    config = _generation_config(target, max_new_tokens, do_sample, temperature, top_p, top_k, pad_id, eos_ids)
    pad_fraction = DEFAULT_PAD_FRACTION if pad_fraction is None else pad_fraction
    return TransformersEngine(
        target, eos_ids, pad_id, batch_size=batch_size, pad_fraction=pad_fraction, generation_config=config
    )


def _pad_id(tokenizer: Any, eos_ids: list[int]) -> int:
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = eos_ids[0] if eos_ids else 0
    return int(pad_id)


def regenerate(
    target: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    out_dir: str | os.PathLike,
    *,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float | None = None,
    top_k: int | None = None,
    shard_size: int = 256,
    max_length: int | None = None,
    system_prompt: str | None = None,
    chat_template: str | None = None,
    chat_template_kwargs: dict | None = None,
    seed: int = 0,
    target_name: str | None = None,
    prompt_source: str | None = None,
    max_shards: int | None = None,
    on_shard: Callable[[int, Path, dict], None] | None = None,
    progress: bool = True,
    engine: Any = None,
    shard_format: str = DEFAULT_SHARD_FORMAT,
) -> dict:
    """Answer `prompts` with the target itself and store the results as training shards in `out_dir`.

    Each prompt is put through the tokenizer's chat template (one user turn, optional system prompt) and answered by
    `engine` (see :mod:`transformers_dflash.data.engines`; default: ``target.generate()`` on length-bucketed batches of at
    most `batch_size`, greedy unless `do_sample`). `target` supplies the EOS ids and the context limit (its ``config``
    and ``generation_config``; a model is needed only for the default engine). Prompt ``i`` lands in shard
    ``i // shard_size``: ``out_dir/shard-XXXXX.parquet`` (`shard_format` "parquet": columns ``input_ids``
    list<int32>, ``loss_mask`` list<bool>, ``prompt_index`` int64) or ``.pt`` ("pt": a ``torch.save``d list of
    ``{"input_ids": LongTensor[L], "loss_mask": BoolTensor[L]}``), in prompt order. ``input_ids`` is prompt + response
    (no padding), ``loss_mask`` is True on response tokens. The response runs up to and including the first EOS token
    (or `max_new_tokens` tokens). :func:`load_shard` reads both formats.

    Resumable: shards are written atomically and existing ones (of either format) are kept, so rerunning after an
    interruption continues where it stopped (``out_dir/manifest.json`` must match the prompts, settings and engine
    settings). Empty prompts and prompts for which prompt + `max_new_tokens` exceeds the context limit (`max_length`,
    default the model's) are skipped and counted. `max_shards` stops after that many new shards; `on_shard(index,
    path, shard_info)` is called after each one. Returns the manifest.
    """
    from .engines import EngineError

    _check_regenerate_arguments(prompts, max_new_tokens, batch_size, shard_size, do_sample, temperature, shard_format)
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplateError(
            f"The tokenizer of {target_name or _model_name(tokenizer)} has no chat template, so the prompts cannot be "
            "formatted the way the target answers them. Fix: use the target's instruct/chat checkpoint (its tokenizer "
            "ships the template), or supply one: regenerate(..., chat_template=JINJA) / `dflash regenerate "
            "--chat-template FILE`, or set tokenizer.chat_template before calling."
        )
    if engine is None:
        engine = default_engine(
            target,
            tokenizer,
            batch_size=batch_size,
            do_sample=do_sample,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_new_tokens=max_new_tokens,
        )
    elif do_sample and not getattr(engine, "do_sample", False):
        raise ValueError(
            f"do_sample=True, but the {engine.name} engine given decodes greedily: sampling is done by the "
            "transformers engine (leave engine=None, or pass a TransformersEngine whose generation_config "
            "samples)"
        )

    empty = [i for i, p in enumerate(prompts) if not p.strip()]
    if len(empty) == len(prompts):
        raise ValueError("all prompts are empty")
    engine.prepare()  # e.g. a server with another tokenizer is refused here, before anything is written
    if empty:
        logger.warning("%d empty prompt(s) will be skipped (first at index %d)", len(empty), empty[0])

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("*.tmp"):  # leftovers of an interrupted write
        stale.unlink()

    limit = max_length if max_length is not None else _context_limit(target, tokenizer)
    eos_ids = _eos_ids(target, tokenizer)
    template_text = chat_template if chat_template is not None else tokenizer.chat_template
    settings = {
        "max_new_tokens": int(max_new_tokens),
        "do_sample": bool(do_sample),
        "temperature": float(temperature) if do_sample else None,
        "top_p": top_p if do_sample else None,
        "top_k": top_k if do_sample else None,
        "seed": int(seed),
        "shard_size": int(shard_size),
        "context_limit": limit,
        "system_prompt": system_prompt,
        "chat_template_sha256": _settings_sha(template_text),
        "chat_template_kwargs": chat_template_kwargs or {},
        "eos_token_ids": eos_ids,
    }
    engine_settings = engine.settings()
    num_prompts = len(prompts)
    p_sha = prompts_sha256(prompts)
    num_shards = math.ceil(num_prompts / shard_size)

    manifest = read_manifest(out_dir)
    if manifest is not None:
        recorded = manifest.get("settings", {})
        diffs = [k for k in settings if recorded.get(k) != settings[k]]
        if manifest.get("num_prompts") != num_prompts or manifest.get("prompts_sha256") != p_sha:
            diffs.append("prompts")
        if not _engine_matches(recorded.get("engine"), engine_settings):
            diffs.append(f"engine ({recorded.get('engine') or {'name': 'transformers'}} there, {engine_settings} now)")
        if diffs:
            raise ResumeMismatchError(
                f"{out_dir} already holds regenerated data made with different {', '.join(diffs)}. Use another --out "
                "directory, or delete this one to start over (rerun with identical arguments to resume)."
            )
        if target_name and manifest.get("target") not in (None, target_name):
            logger.warning("resuming %s made with target %r using target %r", out_dir, manifest["target"], target_name)
    else:
        manifest = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "target": target_name or _model_name(target),
            "tokenizer": _model_name(tokenizer),
            "prompt_source": prompt_source,
            "num_prompts": num_prompts,
            "prompts_sha256": p_sha,
            "settings": settings,
            "shards": {},
        }
    manifest["settings"]["engine"] = engine_settings
    manifest.update(
        num_shards=num_shards,
        batch_size=int(engine.runtime().get("batch_size") or batch_size),
        shard_format=shard_format,
        engine_runtime=engine.runtime(),
        versions=_versions(),
    )
    shards_info: dict = manifest.setdefault("shards", {})

    def finalize() -> None:
        totals = {
            k: sum(s[k] for s in shards_info.values())
            for k in ("examples", "tokens", "response_tokens", "skipped_empty", "skipped_too_long")
        }
        manifest.update(
            shards_done=len(shards_info),
            complete=len(shards_info) == num_shards,
            totals=totals,
            engine_runtime=engine.runtime(),
            updated=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        )

    def write_manifest() -> None:
        finalize()
        write_atomically(
            out_dir / MANIFEST_NAME, json.dumps(manifest, indent=1).encode("utf-8"), "the manifest", len(shards_info)
        )

    def encode_shard(s: int) -> tuple[list[tuple[int, list[int]]], int, int]:
        """(prompt index, chat-formatted token ids) of shard `s`'s usable prompts, and the skipped counts."""
        skipped_empty = skipped_long = 0
        encoded = []
        for i in range(s * shard_size, min(num_prompts, (s + 1) * shard_size)):
            if not prompts[i].strip():
                skipped_empty += 1
                continue
            ids = chat_token_ids(tokenizer, prompts[i], system_prompt, chat_template, chat_template_kwargs)
            if limit is not None and len(ids) + max_new_tokens > limit:
                skipped_long += 1
                continue
            encoded.append((i, ids))
        return encoded, skipped_empty, skipped_long

    # Adopt shards that exist on disk (finished before an interruption). Those the manifest does not record (written
    # just before a crash, or the manifest was deleted) are checked: readable, and holding exactly this shard's prompts.
    pending = []
    for s in range(num_shards):
        key = f"{s:05d}"
        path = _existing_shard(out_dir, s)
        if path is None:
            shards_info.pop(key, None)
            pending.append(s)
        elif key not in shards_info or shards_info[key].get("file") != path.name:
            records = load_shard(path)
            encoded, skipped_empty, skipped_long = encode_shard(s)
            if [r["input_ids"][~r["loss_mask"]].tolist() for r in records] != [ids for _, ids in encoded]:
                raise ResumeMismatchError(
                    f"{path} does not hold the responses to this run's prompts {s * shard_size}.."
                    f"{min(num_prompts, (s + 1) * shard_size) - 1} (made from other prompts or settings). Delete "
                    f"it, or use another --out directory."
                )
            shards_info[key] = _shard_info(path, records, path.read_bytes(), skipped_empty, skipped_long)
    write_manifest()
    if not pending:
        logger.info("%s: all %d shards already done", out_dir, num_shards)
        return manifest
    if len(pending) < num_shards:
        logger.warning("resuming %s: %d of %d shards already done", out_dir, num_shards - len(pending), num_shards)

    todo_prompts = sum(min(num_prompts, (s + 1) * shard_size) - s * shard_size for s in pending)
    bar = _Progress(todo_prompts, progress)
    written = 0
    try:
        for s in pending:
            if max_shards is not None and written >= max_shards:
                break
            encoded, skipped_empty, skipped_long = encode_shard(s)
            if skipped_long:
                logger.warning(
                    "shard %d: %d prompt(s) skipped: prompt + max_new_tokens (%d) exceeds the context limit "
                    "(%d tokens)",
                    s,
                    skipped_long,
                    max_new_tokens,
                    limit,
                )
            try:
                responses = (
                    engine.generate(
                        [ids for _, ids in encoded],
                        max_new_tokens,
                        seed=seed * 1_000_003 + s,
                        on_batch=lambda n, tokens: bar.update(n, tokens, s),
                    )
                    if encoded
                    else []
                )
            except EngineError as e:
                raise type(e)(
                    f"{e}\nShard {s} was not written; the {len(shards_info)} shard(s) finished in {out_dir} "
                    "are kept, and rerunning the same command resumes from there."
                ) from e
            responses = _check_responses(responses, len(encoded), max_new_tokens, engine)
            bar.update(skipped_empty + skipped_long, 0, s)
            records = [
                {
                    "input_ids": torch.tensor(ids + resp, dtype=torch.long),
                    "loss_mask": torch.tensor([False] * len(ids) + [True] * len(resp), dtype=torch.bool),
                }
                for (_, ids), resp in zip(encoded, responses)
            ]
            data = _shard_bytes(records, [i for i, _ in encoded], shard_format)
            path = out_dir / (PARQUET_SHARD_NAME if shard_format == "parquet" else SHARD_NAME).format(s)
            write_atomically(path, data, "shard", len(shards_info))
            info = _shard_info(path, records, data, skipped_empty, skipped_long)
            shards_info[f"{s:05d}"] = info
            write_manifest()
            written += 1
            if on_shard is not None:
                on_shard(s, path, info)
    finally:
        bar.close()

    totals = manifest["totals"]
    elapsed = time.perf_counter() - bar.start
    logger.info(
        "%s: %d/%d shards, %d examples, %d response tokens (%.1f tok/s this run)",
        out_dir,
        manifest["shards_done"],
        num_shards,
        totals["examples"],
        totals["response_tokens"],
        bar.tokens / max(elapsed, 1e-9),
    )
    if totals["skipped_too_long"] or totals["skipped_empty"]:
        logger.warning(
            "%s: skipped %d prompt(s) too long for the context limit and %d empty prompt(s)",
            out_dir,
            totals["skipped_too_long"],
            totals["skipped_empty"],
        )
    return manifest
