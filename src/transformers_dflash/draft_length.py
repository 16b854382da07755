"""How many of a block's drafts to verify (part of the carried core: torch and transformers only).

Verifying fewer drafts is always lossless: the target simply commits fewer tokens this step. Verification cost grows
with the number of tokens on CPUs and at large batch, so low-confidence drafts can cost more than they are expected
to gain. Each policy answers three questions for the decoding loop: run the drafter this step (`wants_draft`)? which
drafts to verify (`trim`)? and, after the step, what did it cost (`record`)?

`drafter.draft_length` picks the policy (`draft_length_policy`):

- `"full"`: verify the whole block (`FullBlock`);
- a float threshold `t` in [0, 1]: verify drafts while the cumulative drafter confidence stays >= t
  (`ConfidenceThreshold`);
- `"auto"`: maximise the expected tokens per second, fitted to the step times of this call (`AutoDraftLength`);
- `None` (the default): the fastest choice measured for the device (docs/benchmarks.md): `"auto"` on CPUs, where
  verifying a wide block costs several plain steps, `"full"` on accelerators.
"""

import itertools
import statistics

import torch


class FullBlock:
    """Verify every draft of the block, every step."""

    uses_confidence = False  # the drafter need not score its own proposals

    def wants_draft(self) -> bool:
        return True

    def draft_beats_copies(self, copy_expected: list[float], num_draft: int) -> bool:
        """Whether the drafter may add to this step's copies (`copy_expected[i]`: the tokens row i's copy is expected
        to have accepted, 0 where none was found)."""
        return True

    def record_drafts(self, confidence: torch.Tensor | None) -> None:
        """The drafter's confidence in the drafts it just proposed `[rows, num_draft]` (None: not scored)."""

    def trim(self, drafts: torch.Tensor, confidence: torch.Tensor | None, paid_draft: bool = True) -> torch.Tensor:
        return drafts

    def record(self, width: int, seconds: float, draft_seconds: float | None = None, accepted=None) -> None:
        """After a step: `width` tokens verified in `seconds`, after a draft of `draft_seconds` (None: the drafter did
        not run); `accepted[i]` drafts of row i were accepted (a tensor, read only by policies that need it)."""


class ConfidenceThreshold(FullBlock):
    """Verify drafts while the cumulative confidence (the product of the drafter's probabilities of its own proposals)
    stays >= `threshold`. Rows of a batch share one verification forward, so the widest row's choice wins."""

    uses_confidence = True

    def __init__(self, threshold: float):
        self.threshold = threshold

    def trim(self, drafts, confidence, paid_draft=True):
        return drafts[:, : int((confidence.cumprod(dim=1) >= self.threshold).sum(dim=1).max())]


class AutoDraftLength(FullBlock):
    """Pick the number of drafts k (0 = a plain decoding step) that maximises expected tokens per second,
    `(1 + sum_{j<=k} P_j) / (draft + verify(k + 1))`.

    `P_j` is the cumulative confidence of draft j, `draft` the mean measured draft time and `verify(w)` the measured
    time of verifying w tokens in this generate() call: the median of the steps of that width, else a least-squares line
    through all steps (and no more than the line while a width has few steps, `step_costs`). The first two steps
    measure one draft (width 2) and no draft (width 1); wider blocks are tried when the line predicts that they pay,
    and are then measured. Exploring from the narrow end keeps a large batch, where a full block costs several plain
    steps, from paying for it just to learn that it does not pay. A table rather than a line, because on CPUs one token
    can be much cheaper than two while two to eight cost about the same.
    The draft's cost is the mean of the drafts after a call's first (which also reads the whole prompt's context).

    When drafting loses even so, the next steps skip the drafter altogether; it is asked again after 1, 2, 4, ... 16
    skipped steps, and drafting resumes as soon as it wins. Drafting loses when the expected rate of the last drafted
    step is below a plain step's (e.g. at a large batch with doubtful drafts), or when the rate the drafted steps
    REALISED is: tokens committed per second of draft + verification, a running mean that keeps `REALISED_DECAY` of
    its weight per drafted step. The drafter's confidence in its own proposals is only an estimate, and an
    overconfident drafter would otherwise keep drafting at a loss (measured: a drafter whose verified drafts were
    accepted 17 % of the time ran at 0.77x plain decoding). Its seconds are the estimated costs of the steps taken
    (`_step_cost`), not their measured times, so that timing noise does not decide whether the drafter runs. Skipped
    steps keep their target features for the drafter's next context, so skipping costs no accuracy. Rows of a batch
    share one verification forward: the chosen length maximises the expected tokens per second of the whole batch
    (the sum over rows).

    One instance serves the generate() calls of one drafter on one device, thread count and batch size
    (`DFlashCandidateGenerator`, `drafter.draft_length_memory`): each call starts from the step costs and draft costs
    the earlier ones measured (`start_call`), so it does not explore widths again; whether drafting pays depends on
    the text, so each call judges that afresh.
    """

    uses_confidence = True
    TRUSTED = 3  # steps of a width after which its measured (median) cost is taken as it is (see `step_costs`)
    COMPARED = 8  # drafts scored before a good copy may skip the drafter (`draft_beats_copies`)
    REALISED_DECAY = 0.8  # weight the earlier drafted steps keep in the realised rate, per drafted step
    KEPT = 32  # steps of each width, and drafts, that a new call keeps from the earlier ones (`start_call`)

    def __init__(self):
        # width -> seconds of each step that verified that many tokens (verify + commit + any re-feed), oldest first
        self.step_times: dict[int, list[float]] = {}
        self._costs: list[float] | None = None  # `step_costs` of the current step times, as far as computed
        self.draft_seconds: list[float] = []  # seconds of each draft but a call's first
        self.draft_expected: list[float] = []  # per row of each draft: its drafts' expected accepted tokens
        self.first_draft_seconds: float | None = None  # seconds of the last call's first draft
        self._judge_afresh()

    def _judge_afresh(self) -> None:
        """Forget whether drafting pays (a new call's text may suit the drafter better or worse); the step and draft
        costs stay. Its first draft will read the prompt."""
        self.awaiting_first_draft = True
        self.draft_rate: float | None = None  # expected tokens/s per row of the last drafted step, as chosen
        self.realised_tokens = self.realised_seconds = 0.0  # drafted steps: decayed sums (see the class docstring)
        self.skipped, self.backoff = 0, 1

    def start_call(self) -> None:
        """A new generate() call: keep the last `KEPT` steps of each width and the last `KEPT` drafts (older ones,
        from other contexts, age out); start the realised rate and the back-off afresh (a new text may suit the
        drafter better or worse); its first draft will read the prompt."""
        self.step_times = {width: times[-self.KEPT :] for width, times in self.step_times.items()}
        self._costs = None
        self.draft_seconds = self.draft_seconds[-self.KEPT :]
        self.draft_expected = self.draft_expected[-self.KEPT :]
        self._judge_afresh()

    def record(self, width, seconds, draft_seconds=None, accepted=None):
        """A step verified `width` tokens in `seconds`, after a draft of `draft_seconds` (None: no draft);
        `accepted[i]`: the drafts row i accepted."""
        self.step_times.setdefault(width, []).append(seconds)
        self._costs = None
        if draft_seconds is None:
            return
        if self.awaiting_first_draft:  # it also read the prompt's context: neither a draft's cost nor its rate
            self.first_draft_seconds, self.awaiting_first_draft = draft_seconds, False
            return
        self.draft_seconds.append(draft_seconds)
        if accepted is not None:
            committed = 1.0 + float(accepted.float().mean())  # per row: the accepted drafts and the bonus token
            self.realised_tokens = self.REALISED_DECAY * self.realised_tokens + committed
            self.realised_seconds = self.REALISED_DECAY * self.realised_seconds + self._step_cost(width, seconds)

    def _step_cost(self, width: int, seconds: float) -> float:
        """What a drafted step of `width` tokens costs in the realised rate: the mean draft and the estimated cost
        of verifying that width (`step_costs`), not this step's own times (`seconds` only while there is no estimate
        yet). The realised rate is there to catch drafts accepted less often than the drafter's confidence says; a
        single slow step (the OS, another process) must not make drafting look like a loss and start the back-off."""
        costs = self.step_costs(width)
        if costs is None:
            return self.draft_seconds[-1] + seconds
        return sum(self.draft_seconds) / len(self.draft_seconds) + costs[width - 1]

    def record_drafts(self, confidence):
        if confidence is not None:
            self.draft_expected += confidence.float().cumprod(dim=1).sum(dim=1).tolist()
            del self.draft_expected[: -self.KEPT]

    def draft_beats_copies(self, copy_expected, num_draft):
        """Whether drafting is expected to add more tokens than its cost in time, given this step's copies: where a
        row's copy is expected to have more tokens accepted than the drafter's drafts, the copy heads the block
        (`NgramLookup.merge`) and the draft was paid for nothing. The drafter's gain on row i is taken as the mean
        of max(0, e - copy_expected[i]) over the expected accepted tokens e of its last `KEPT` drafts; its cost, the
        tokens per second the copy-only step is expected to commit times the draft's seconds. The drafter's and the
        copy's expectations were found nearly uncorrelated (docs/benchmarks.md), so its past drafts stand for this
        step's."""
        if len(self.draft_expected) < self.COMPARED or not self.draft_seconds:
            return True
        costs = self.step_costs(num_draft + 1)
        if costs is None:
            return True
        draft_share = (sum(self.draft_seconds) / len(self.draft_seconds)) / costs[-1]  # of the whole block's step
        gain = sum(sum(max(e - c, 0.0) for e in self.draft_expected) for c in copy_expected) / len(self.draft_expected)
        return gain > draft_share * sum(1.0 + c for c in copy_expected)

    def wants_draft(self) -> bool:
        """Whether to run the drafter this step (False while drafting loses to plain steps)."""
        if 1 not in self.step_times and self.step_times:  # exploring a plain step: no draft to pay for
            return False
        if self.draft_rate is None:
            return True
        plain_cost = self.step_costs(1)[0]
        rate = self.draft_rate
        if self.realised_seconds:
            rate = min(rate, self.realised_tokens / self.realised_seconds)
        if rate >= 1.0 / plain_cost:
            self.skipped, self.backoff = 0, 1
            return True
        if self.skipped < self.backoff:
            self.skipped += 1
            return False
        self.skipped, self.backoff = 0, min(2 * self.backoff, 16)  # ask the drafter again; wait longer if it loses
        return True

    def _cost_line(self):
        """(intercept, slope) of the least-squares line through all steps' (width, seconds); None before two widths."""
        if len(self.step_times) < 2:
            return None
        counts = {w: len(ts) for w, ts in self.step_times.items()}
        sums = {w: sum(ts) for w, ts in self.step_times.items()}
        n = sum(counts.values())
        mean_w = sum(w * c for w, c in counts.items()) / n
        mean_t = sum(sums.values()) / n
        var = sum(c * (w - mean_w) ** 2 for w, c in counts.items())
        slope = max(sum((w - mean_w) * (sums[w] - counts[w] * mean_t) for w in counts) / var, 0.0)
        return mean_t - slope * mean_w, slope

    def step_costs(self, max_width: int) -> list[float] | None:
        """Estimated seconds of a step verifying w = 1 .. max_width tokens (None before two widths were measured).

        A width measured at least `TRUSTED` times (and width 1, a plain step) costs its median; an unmeasured one is
        interpolated between the measured widths around it, or read off the line through all steps. A width measured
        fewer times costs at most what the line predicts: step times on a busy CPU vary by half, and one slow step
        would otherwise make a width look dear for the rest of the call, so that it is never chosen, never measured
        again, and its drafts never verified. Trying it again costs a step or two; it then keeps its measured cost.
        No width costs less than a narrower one: a wider verification is never cheaper, and where noise made it look so,
        drafts with no chance of acceptance (zero confidence: no copy and no drafter this step) were verified for
        nothing (measured: 47 of 118 steps of one call).

        The table is computed once per change of the step times, for the widest width asked for since: the decoding
        loop asks up to four times per step (the policy's own work per step: 0.08 ms recomputing each time, 0.04 ms
        so, on a 2-core Xeon with 200 steps recorded)."""
        if self._costs is None or len(self._costs) < max_width:
            self._costs = self._compute_step_costs(max(max_width, len(self._costs or ())))
        return None if self._costs is None else self._costs[:max_width]

    def _compute_step_costs(self, max_width: int) -> list[float] | None:
        line = self._cost_line()
        if line is None:
            return None
        intercept, slope = line
        on_line = [max(intercept + slope * w, 1e-9) for w in range(max(max_width, *self.step_times) + 1)]
        # Not width 1: a plain step is what drafting is weighed against, and rating it cheaper than measured would
        # make drafting look worse than it is.
        measured = {}
        for w, ts in self.step_times.items():
            typical = statistics.median(ts)  # not the mean: one step slowed by something else would move it
            measured[w] = typical if len(ts) >= self.TRUSTED or w == 1 else min(typical, on_line[w])
        costs = []
        for w in range(1, max_width + 1):
            below = [m for m in measured if m < w]
            above = [m for m in measured if m > w]
            if w in measured:
                costs.append(measured[w])
            elif below and above:  # between two measured widths: interpolate
                lo, hi = max(below), min(above)
                costs.append(measured[lo] + (measured[hi] - measured[lo]) * (w - lo) / (hi - lo))
            else:
                costs.append(on_line[w])
        return list(itertools.accumulate(costs, max))  # never below a narrower width's

    def num_to_verify(self, confidence: torch.Tensor, paid_draft: bool = True) -> int:
        """Drafts to verify, from per-row confidences `[rows, num_draft]`. `paid_draft=False`: the drafter did not run
        this step (only copied drafts, see `NgramLookup`), so its cost and its rate are left out."""
        num_draft = confidence.shape[1]
        if 2 not in self.step_times:  # explore: one draft ...
            return min(1, num_draft)
        if 1 not in self.step_times:  # ... then no draft at all
            return 0
        drafts = self.draft_seconds or [self.first_draft_seconds or 0.0]
        draft = sum(drafts) / len(drafts) if paid_draft else 0.0
        costs = [draft + c for c in self.step_costs(num_draft + 1)]
        costs = torch.tensor(costs, dtype=torch.float32, device=confidence.device)
        cumulative = confidence.cumprod(dim=1)
        gained = 1 + torch.cat([cumulative.new_zeros(cumulative.shape[0], 1), cumulative.cumsum(dim=1)], dim=1)
        # Rows share one forward: maximise the whole batch's expected tokens per second, not the greediest row's.
        rate = gained.float().sum(dim=0) / costs
        best = int(rate.argmax())
        if paid_draft:
            self.draft_rate = float(rate[best]) / confidence.shape[0]
        return best

    def trim(self, drafts, confidence, paid_draft=True):
        return drafts[:, : self.num_to_verify(confidence, paid_draft)]  # synchronises


def default_draft_length(device: torch.device) -> str:
    """The fastest setting measured for the device (docs/benchmarks.md): "auto" on CPUs, "full" on accelerators."""
    return "auto" if torch.device(device).type == "cpu" else "full"


def draft_length_policy(setting, device: torch.device | str = "cpu"):
    """The policy for a `drafter.draft_length` setting (see the module docstring); a ValueError for anything else."""
    if setting is None:
        setting = default_draft_length(device)
    if setting == "full":
        return FullBlock()
    if setting == "auto":
        return AutoDraftLength()
    if isinstance(setting, (int, float)) and not isinstance(setting, bool) and 0.0 <= float(setting) <= 1.0:
        return ConfidenceThreshold(float(setting))
    raise ValueError(
        f"drafter.draft_length={setting!r} is not valid: use None (the device's default), 'full' (whole block), a "
        "confidence threshold in [0, 1], or 'auto'."
    )
