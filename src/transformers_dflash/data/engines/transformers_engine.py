"""The transformers engine of `dflash regenerate`: `model.generate()` on length-bucketed, left-padded batches."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...state_rollback import has_recurrent_state
from ...target_model import cache_keyword
from .base import DEFAULT_PAD_FRACTION, OnBatch, generate_in_buckets, model_dtype, response_ids
from .kv_cache import reserved_kv_cache


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
        return {"name": self.name, "dtype": model_dtype(self.model), "do_sample": self.do_sample}

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
        # The default cache would copy itself at every step; this one fills room for prompt + new tokens. A cache the
        # generation config asks for by name, or a hybrid target's own, is left to generate().
        cache = None
        if not getattr(config, "cache_implementation", None) and not has_recurrent_state(self.model):
            cache = reserved_kv_cache(self.model, width + config.max_new_tokens)
        cache_kwargs = {} if cache is None else {cache_keyword(self.model): cache}
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                generation_config=config,
                **cache_kwargs,
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
