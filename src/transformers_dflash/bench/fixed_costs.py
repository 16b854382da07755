"""Step costs held fixed, so that a benchmark compares drafters by their drafts alone.

At the defaults on CPUs, `"auto"` (`draft_length.AutoDraftLength`) picks each step's width from the step times it
measures during the call; timing noise then changes which drafts are verified, and with them tau and speed: two runs
of the same prompts once put the same pair of drafters at 1.09x and 0.97x (docs/training.md, "On one GPU").

`dflash bench --fixed-step-costs` measures the costs once (`measure_step_costs`) or reads them from a file, then runs
every "auto" method with `FixedCostDraftLength`: the same choices as `"auto"`, but from that one table of costs, so
that its choices, its tau and its *modelled* time (the table's cost of the steps it took) depend only on the drafts.
Wall time is still measured and reported beside it.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..draft_length import AutoDraftLength, FullBlock
from .drafter import draft_length, draft_length_memory, ngram_lookup


def drafter_shape(drafter) -> str:
    """What a draft's cost depends on: the drafter's layers, widths, block and draft vocabulary. Drafters of one
    shape (a drafter and its fine-tuned copy) are given one draft cost, so that only their drafts differ."""
    config = drafter.config
    keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "block_size")
    shape = {key: getattr(config, key, None) for key in keys}
    shape["draft_vocab_size"] = getattr(config, "draft_vocab_size", None)
    shape["target_layers"] = len(getattr(config, "target_layer_ids", []) or [])
    return json.dumps(shape, sort_keys=True)


@dataclass
class StepCosts:
    """Seconds of a decoding step: `verify_seconds[w - 1]` to verify w tokens (w = 1: a plain step), and
    `draft_seconds[shape]` for one draft by a drafter of that `drafter_shape`."""

    verify_seconds: list[float]
    draft_seconds: dict[str, float] = field(default_factory=dict)

    def __post_init__(self):
        if not self.verify_seconds or any(not s > 0 for s in self.verify_seconds):
            raise ValueError(f"step costs need positive verify_seconds for widths 1, 2, ...; got {self.verify_seconds}")

    def verify(self, width: int) -> float:
        """Seconds to verify `width` tokens: beyond the table, the line through its last two widths."""
        table = self.verify_seconds
        if width <= len(table):
            return table[width - 1]
        slope = max(table[-1] - table[-2], 0.0) if len(table) > 1 else 0.0
        return table[-1] + slope * (width - len(table))

    def draft(self, drafter) -> float:
        shape = drafter_shape(drafter)
        if shape not in self.draft_seconds:
            raise ValueError(
                f"the fixed step costs have no draft cost for a drafter of shape {shape}; measure it with "
                "measure_step_costs(..., costs=...) (dflash bench --fixed-step-costs does so by itself)"
            )
        return self.draft_seconds[shape]

    def to_dict(self) -> dict:
        return {"verify_seconds": list(self.verify_seconds), "draft_seconds": dict(self.draft_seconds)}

    @classmethod
    def from_dict(cls, data: dict) -> StepCosts:
        return cls([float(s) for s in data["verify_seconds"]], {k: float(v) for k, v in data["draft_seconds"].items()})

    @classmethod
    def load(cls, path) -> StepCosts:
        """From a JSON file of `to_dict`'s keys, or a `dflash bench` report (its settings' `fixed_step_costs`)."""
        try:
            data = json.loads(Path(path).read_text())
            data = data.get("settings", {}).get("fixed_step_costs", data)
            return cls.from_dict(data)
        except FileNotFoundError:
            raise ValueError(f"no step-cost file at {path}") from None
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(
                f"{path} holds no step costs ({error}); give a file that `dflash bench --fixed-step-costs` wrote "
                "(its JSON report) or one with verify_seconds and draft_seconds"
            ) from None


class FixedCostDraftLength(AutoDraftLength):
    """`"auto"` with the step and draft costs of a `StepCosts` table instead of the ones it measures: every step is
    recorded at the table's cost, so its choices (and the realised rate that decides whether to draft at all) depend
    on the drafts only. `modelled_seconds` adds up the table's cost of every step taken."""

    def __init__(self, costs: StepCosts, draft_seconds: float):
        super().__init__()
        self.costs, self.draft_cost = costs, draft_seconds
        # Both widths "measured": nothing left to explore, every choice is made from the table.
        self.step_times = {1: [costs.verify(1)], 2: [costs.verify(2)]}
        self.draft_seconds = [draft_seconds]
        self.first_draft_seconds = draft_seconds
        self.modelled_seconds = 0.0

    def step_costs(self, max_width: int) -> list[float]:
        return [self.costs.verify(w) for w in range(1, max_width + 1)]

    def record(self, width, seconds, draft_seconds=None, accepted=None):
        seconds = self.costs.verify(width)
        draft = None if draft_seconds is None else self.draft_cost
        self.modelled_seconds += seconds + (draft or 0.0)
        super().record(width, seconds, draft, accepted)


def fixed_cost_policy(memory: dict) -> FixedCostDraftLength | None:
    """The fixed-cost policy a method's memory holds (None before its first call)."""
    return next((p for p in memory.values() if isinstance(p, FixedCostDraftLength)), None)


def _auto_key(drafter, batch_size: int = 1) -> tuple:
    """Where a drafter's memory keeps its "auto" policy (`DFlashCandidateGenerator._resume`'s key)."""
    import torch

    return ("auto", next(drafter.parameters()).device.type, torch.get_num_threads(), batch_size)


def seed_memory(memory: dict, costs: StepCosts, drafter, batch_size: int = 1) -> None:
    """Make `memory` (a method's `drafter.draft_length_memory`) hand out a `FixedCostDraftLength` wherever "auto"
    would start from its own measurements."""
    key = _auto_key(drafter, batch_size)
    if not isinstance(memory.get(key), FixedCostDraftLength):
        memory[key] = FixedCostDraftLength(costs, costs.draft(drafter))


class _FixedWidth(FullBlock):
    """Verify `width` tokens every step (`width - 1` drafts; 1: plain steps) and keep each step's time, and each
    draft's but a call's first (which also reads the prompt): what `measure_step_costs` runs in the decoding loop,
    in place of "auto"."""

    def __init__(self, width: int):
        self.width, self.seconds, self.draft_seconds, self.first = width, [], [], True

    def start_call(self) -> None:
        self.first = True

    def wants_draft(self) -> bool:
        return self.width > 1

    def trim(self, drafts, confidence, paid_draft=True):
        return drafts[:, : self.width - 1]

    def record(self, width, seconds, draft_seconds=None, accepted=None):
        if width == self.width:  # not the last steps, cut short by the token budget
            self.seconds.append(seconds)
        if draft_seconds is not None and not self.first:
            self.draft_seconds.append(draft_seconds)
        self.first = self.first and draft_seconds is None


def measure_step_costs(
    target, drafters, input_ids, generate_kwargs: dict, block_size: int, rounds: int = 3, costs: StepCosts | None = None
) -> StepCosts:
    """Step costs measured in the decoding loop itself: the reference drafter (`drafters[0]`) decodes `input_ids`
    verifying w = 1 .. `block_size` tokens every step, the widths interleaved over `rounds` rounds; each width costs
    the median of its steps (and no less than a narrower width), a draft the median of the drafts. Every other drafter
    shape gets the median draft of its own whole-block runs. No copied drafts: a draft's cost is the drafter's.
    Given `costs`, only the draft costs of the shapes it lacks are measured, and added to it."""
    from statistics import median

    for drafter in drafters:
        shape = drafter_shape(drafter)
        if costs is not None and shape in costs.draft_seconds:
            continue
        widths = range(1, block_size + 1) if costs is None else [min(block_size, drafter.config.block_size)]
        policies = {w: _FixedWidth(w) for w in widths}
        for _ in range(rounds):
            for policy in policies.values():
                memory = {_auto_key(drafter): policy}
                with draft_length(drafter, "auto"), ngram_lookup(drafter, 0), draft_length_memory(drafter, memory):
                    target.generate(input_ids, assistant_model=drafter, **generate_kwargs)
        drafts = [s for p in policies.values() for s in p.draft_seconds]
        if not drafts or any(not p.seconds for p in policies.values()):
            raise ValueError(
                "measuring the step costs needs a few decoding steps at every width; raise --max-new-tokens or give "
                "the costs as a file"
            )
        if costs is None:
            costs = StepCosts(list(itertools.accumulate((median(policies[w].seconds) for w in widths), max)))
        costs.draft_seconds[shape] = median(drafts)
    return costs
