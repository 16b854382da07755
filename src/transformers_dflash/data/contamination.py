"""Keeping training prompts disjoint from the evaluation sets: normalisation, shingle fingerprints and the
overlap filter (shipped as hashes in `transformers_dflash/prompts/eval_fingerprints.json`)."""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
import zlib
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources

from .eval_sets import HUMANEVAL_INSTRUCTION, load_humaneval_problems, load_mtbench_questions

_NON_WORD = re.compile(r"[\W_]+", re.UNICODE)
SHINGLE_WORDS = 8
FINGERPRINT_SAMPLE = 4  # shipped shingles: those whose crc32 % 4 == 0 (all of them for short texts)
FINGERPRINT_FULL_BELOW = 24  # texts with fewer shingles than this keep all of them
CONTAMINATION_THRESHOLD = 0.5


def normalize_prompt(text: str) -> str:
    """Canonical form used for deduplication: NFKC, lower case, punctuation and whitespace collapsed to one space."""
    return _NON_WORD.sub(" ", unicodedata.normalize("NFKC", text).lower()).strip()


def _text_hash(normalized: str) -> str:
    return hashlib.sha1(normalized.encode("utf-8")).hexdigest()[:16]


def _shingles(normalized: str) -> set[int]:
    words = normalized.split()
    if len(words) < SHINGLE_WORDS:
        return {zlib.crc32(" ".join(words).encode("utf-8"))} if words else set()
    return {
        zlib.crc32(" ".join(words[i : i + SHINGLE_WORDS]).encode("utf-8"))
        for i in range(len(words) - SHINGLE_WORDS + 1)
    }


def _fingerprint(text: str) -> list:
    norm = normalize_prompt(text)
    sh = _shingles(norm)
    if len(sh) >= FINGERPRINT_FULL_BELOW:
        sh = {h for h in sh if h % FINGERPRINT_SAMPLE == 0}
    return [_text_hash(norm), sorted(sh)]


def compute_eval_fingerprints() -> dict:
    """Fingerprints of every MT-Bench turn and every HumanEval prompt (needs both packages installed).

    The result is what ``prompts/eval_fingerprints.json`` ships, so the overlap filter works (and gives the same
    training set) on machines without the evaluation packages.
    """
    mt_texts = [t for q in load_mtbench_questions() for t in q["turns"]]
    he = load_humaneval_problems()
    he_texts = [p["prompt"] for p in he] + [HUMANEVAL_INSTRUCTION.format(prompt=p["prompt"]) for p in he]
    return {
        "description": "Hashes of normalized MT-Bench turns and HumanEval prompts (no text), used to keep training "
        "prompts disjoint from the evaluation sets. Rebuild with "
        "transformers_dflash.data.compute_eval_fingerprints().",
        "shingle_words": SHINGLE_WORDS,
        "sources": {
            "mtbench": [_fingerprint(t) for t in mt_texts],
            "humaneval": [_fingerprint(t) for t in he_texts],
        },
    }


@dataclass
class _EvalFilter:
    exact: set = field(default_factory=set)
    shingle_to_items: dict = field(default_factory=dict)
    item_sizes: list = field(default_factory=list)

    @classmethod
    def from_fingerprints(cls, fp: dict) -> _EvalFilter:
        flt = cls()
        for items in fp["sources"].values():
            for exact, shingles in items:
                flt.exact.add(exact)
                idx = len(flt.item_sizes)
                flt.item_sizes.append(len(shingles))
                for h in shingles:
                    flt.shingle_to_items.setdefault(h, []).append(idx)
        return flt

    def contaminated(self, text: str) -> bool:
        norm = normalize_prompt(text)
        if _text_hash(norm) in self.exact:
            return True
        hits: dict[int, int] = {}
        for h in _shingles(norm):
            for idx in self.shingle_to_items.get(h, ()):
                hits[idx] = hits.get(idx, 0) + 1
        return any(n >= CONTAMINATION_THRESHOLD * self.item_sizes[idx] for idx, n in hits.items())


@lru_cache(maxsize=1)
def _shipped_eval_filter() -> _EvalFilter:
    with resources.files("transformers_dflash.prompts").joinpath("eval_fingerprints.json").open("r") as f:
        return _EvalFilter.from_fingerprints(json.load(f))


def is_eval_contaminated(text: str) -> bool:
    """True if `text` equals or largely contains an MT-Bench turn or a HumanEval prompt (normalized comparison)."""
    return _shipped_eval_filter().contaminated(text)
