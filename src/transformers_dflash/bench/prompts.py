"""The prompts a benchmark runs: MT-Bench, HumanEval or a JSONL file, all of them or a spread of them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def select_prompts(prompts: Sequence[Any], n: int, how: str = "spread") -> tuple[list[int], list[Any]]:
    """`n` prompts and their indices: the first `n`, or `n` evenly spaced over the list."""
    n = max(0, min(n, len(prompts)))
    if how == "first" or n == len(prompts):
        indices = list(range(n))
    else:
        indices = [int(i * len(prompts) / n) for i in range(n)]
    return indices, [prompts[i] for i in indices]


def load_dataset_prompts(spec: str) -> tuple[str, list[str]]:
    """`(name, prompts)` for `mtbench`, `humaneval` or a JSONL path (named by its file stem)."""
    from .. import data

    if spec == "mtbench":
        return "mtbench", data.load_mtbench_prompts()
    if spec == "humaneval":
        return "humaneval", data.load_humaneval_prompts()
    return Path(spec).stem, data.load_jsonl_prompts(spec)
