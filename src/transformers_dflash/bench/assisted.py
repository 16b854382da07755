"""What transformers' own assisted loop accepted (and proposed), recorded step by step for one `generate()` call."""

from __future__ import annotations

import contextlib
import functools


class AssistedRecorder:
    """Records, for transformers' own assisted loop, the tokens committed per target forward (n_matches + 1) and
    optionally each step's drafts, by wrapping the candidate generator `generate()` builds for one call."""

    def __init__(self, record_drafts: bool = False):
        self.acceptance: list[int] = []
        self.drafts: list[list[int]] = []
        self.record_drafts = record_drafts

    @contextlib.contextmanager
    def watch(self):
        from transformers.generation.utils import GenerationMixin

        original = GenerationMixin._get_candidate_generator
        recorder = self

        @functools.wraps(original)
        def get_candidate_generator(model, *args, **kwargs):
            generator = original(model, *args, **kwargs)
            update = generator.update_candidate_strategy

            def update_candidate_strategy(input_ids, scores, num_matches):
                recorder.acceptance.append(int(num_matches) + 1)
                return update(input_ids, scores, num_matches)

            generator.update_candidate_strategy = update_candidate_strategy
            if recorder.record_drafts:
                get_candidates = generator.get_candidates

                def recorded_get_candidates(input_ids, *a, **k):
                    candidates, logits = get_candidates(input_ids, *a, **k)
                    recorder.drafts.append(candidates[0, input_ids.shape[1] :].tolist())
                    return candidates, logits

                generator.get_candidates = recorded_get_candidates
            return generator

        GenerationMixin._get_candidate_generator = get_candidate_generator
        try:
            yield self
        finally:
            GenerationMixin._get_candidate_generator = original
