"""Drafts copied from the sequence itself (prompt lookup), merged into DFlash's blocks (part of the carried core).

`drafter.ngram_lookup` sets it: `None` (the default) picks the device's fastest measured setting (docs/benchmarks.md:
6 on CPUs, off on accelerators), `0` turns it off, `n >= 1` matches n-grams of up to n tokens.
"""

from typing import NamedTuple

import torch


class Copy(NamedTuple):
    """A row's copied continuation: found by its last `match` tokens, the `tokens` that followed them before, each
    token's confidence (`rates`, its depth's acceptance rate) and the tokens expected accepted (`expected`, the sum
    of the rates' cumulative products)."""

    match: int
    tokens: torch.Tensor
    rates: torch.Tensor
    expected: float


class CopyAcceptance:
    """How often a copied draft at each depth of the block is accepted once the copies before it were, for the copies
    found by one match length: `hits[j]` of `tries[j]`. `rates` is the confidence `"auto"` gives such a copy."""

    TRUSTED = 3  # copies verified at a depth after which its measured rate is taken as it is (see `rates`)
    FORGET = 0.9  # the weight left to a depth's counts each time its copy is proposed but not verified (`record`)
    CARRIED = 8  # tries per depth that a new generate() call starts with at most (`start_call`)

    def __init__(self, block_size: int):
        self.hits = [0] * block_size  # copies accepted at depth j ...
        self.tries = [0] * block_size  # ... out of copies verified at depth j with all earlier ones accepted

    @property
    def rates(self) -> torch.Tensor:
        """The measured rate at which a copy at each depth is accepted once the copies before it were, shrunk towards
        the rate of the depth before (1/2 for the first). An untried depth looks like the last tried one, so copies
        that keep being accepted (a repetition loop) get verified ever deeper, as prompt lookup would. A depth tried
        fewer than `TRUSTED` times is not rated below the depth before: one early rejection would otherwise stop its
        copies from being verified, and so from ever being measured again."""
        rates, prior = [], 0.5
        for hits, tries in zip(self.hits, self.tries):
            rate = (hits + 2 * prior) / (tries + 2)
            prior = rate if tries >= self.TRUSTED else max(rate, prior)
            rates.append(prior)
        return torch.tensor(rates)

    def start_call(self) -> None:
        """A new generate() call: keep each depth's measured rate, but as if from at most `CARRIED` tries, so that
        a new text (code after prose) moves it within a few copies."""
        for depth, tries in enumerate(self.tries):
            if tries > self.CARRIED:
                self.hits[depth] *= self.CARRIED / tries
                self.tries[depth] = self.CARRIED

    def record(self, copied: int, accepted: int, verified: int) -> None:
        """A row's block began with `copied` copies; `verified` drafts were checked and the first `accepted` kept.

        A copy that was proposed but not verified (the policy stopped before it, every draft before it accepted) says
        nothing about its depth's rate, but the text may have changed since that depth was last tried: its counts are
        scaled by `FORGET`, so a depth that stopped being verified drifts back to its prior and gets tried again (a
        long answer can turn from prose, where copies fail, to a list or code, where they are accepted)."""
        for j in range(min(copied, verified, accepted + 1)):
            self.tries[j] += 1
            self.hits[j] += j < accepted
        if verified < copied and accepted == verified:
            self.tries[verified] *= self.FORGET
            self.hits[verified] *= self.FORGET


class NgramLookup:
    """Drafts copied from the sequence itself (prompt lookup), merged into DFlash's blocks: `drafter.ngram_lookup = n`.

    When a row's last n (then n - 1, ... 1) committed tokens occurred earlier in that row, the tokens that followed
    their most recent earlier occurrence replace the head of the row's block. Small models often repeat themselves
    (lists, code, loops), and there such copies are accepted far more often than a weak drafter's guesses. Like any
    proposal they are verified by the target, so the output is unchanged.

    With `draft_length="auto"` each copied token's confidence is its depth's measured acceptance rate in this call
    (`CopyAcceptance`), kept apart for each match length: a copy found by the last two tokens is accepted several
    times as often as one found by the last token alone (docs/benchmarks.md, "Copies by match length"), and one
    shared rate made the policy verify the second kind at a loss. So the policy verifies copies as far as copies of
    their kind have been paying off; when the drafter is skipped, copies are still proposed (they cost no drafter
    forward).

    A row whose drafter ran and scored its drafts keeps them instead of the copy where it expects more of them
    accepted: the sum of their cumulative confidences against that of the copy's rates. Once a text has a few dozen
    tokens, nearly every last token occurred before, so a copy would otherwise replace the drafter's drafts at almost
    every step, however sure the drafter and however poor 1-gram copies had been (measured: a better drafter then
    changed the defaults' speed by 0-1 %, docs/training.md).
    """

    def __init__(self, max_ngram_size: int, block_size: int):
        self.max_ngram_size = max_ngram_size
        self.acceptance = {n: CopyAcceptance(block_size) for n in range(1, max_ngram_size + 1)}  # by match length
        self.copied: list[tuple[int, int]] = []  # per row of the last step: (match length, tokens copied)

    def _continuation(self, tokens: torch.Tensor, num_draft: int) -> tuple[int, torch.Tensor] | None:
        """The longest match length n whose last n tokens occurred earlier, and what followed their most recent
        earlier occurrence (None: none). One pass for every n: for each earlier end position, how many tokens back
        from it agree with the sequence's own last tokens (a scan per n made `ngram_lookup=6` cost 4x `2`)."""
        width = min(self.max_ngram_size, tokens.shape[0] - 1)
        if width < 1:
            return None
        # earlier[e] = the `width` tokens ending at position e (e < the last), left-padded with -1, which no token is
        earlier = torch.cat([tokens.new_full((width - 1,), -1), tokens[:-1]]).unfold(0, width, 1)
        agree = (earlier == tokens[-width:]).flip(1).int().cumprod(dim=1).sum(dim=1)  # match length ending at e
        # the longest match, the most recent among equals (argmax picks the first of equal maxima: search reversed)
        end = agree.shape[0] - 1 - int(agree.flip(0).argmax())
        match = int(agree[end])
        return (match, tokens[end + 1 : end + 1 + num_draft]) if match else None

    def start_call(self) -> None:
        """A new generate() call (the same lookup serves a drafter's calls, `DFlashCandidateGenerator`)."""
        for acceptance in self.acceptance.values():
            acceptance.start_call()
        self.copied = []

    @staticmethod
    def _keeps_drafts(copy_expected: float, draft_expected: float) -> bool:
        """Whether a row keeps the drafter's drafts rather than the copy: when more of them are expected accepted
        (each the sum of its cumulative confidences)."""
        return draft_expected > copy_expected

    def find(self, sequences, active, lengths, num_draft: int) -> list[Copy | None]:
        """Per row: its `Copy`, or None where the row's last tokens did not occur before."""
        rates = {n: acceptance.rates for n, acceptance in self.acceptance.items()}
        found = []
        for r in active:
            continuation = self._continuation(sequences[r, : lengths[r]], num_draft)
            if continuation is None:
                found.append(None)
                continue
            match, tokens = continuation
            copy_rates = rates[match][: tokens.shape[0]]
            found.append(Copy(match, tokens, copy_rates, float(copy_rates.cumprod(dim=0).sum())))
        return found

    def merge(self, found: list[Copy | None], drafts, confidence, num_draft: int):
        """Drafts `[rows, num_draft]` (and per-token confidences): each row's copy (`found`, this step's `find`) at its
        head, unless the drafter scored its own drafts (`confidence`) and expects more of them accepted
        (`_keeps_drafts`)."""
        rows = len(found)
        if drafts.shape[1] < num_draft:  # the drafter did not run this step: pad, with zero confidence
            drafts = torch.cat([drafts, drafts.new_zeros(rows, num_draft - drafts.shape[1])], dim=1)
        scored = confidence is not None
        confidence = confidence.clone() if scored else torch.zeros(rows, num_draft)
        expected = confidence.float().cumprod(dim=1).sum(dim=1).tolist() if scored else [0.0] * rows
        self.copied = [(0, 0)] * rows
        for i, copy in enumerate(found):
            if copy is None or self._keeps_drafts(copy.expected, expected[i]):
                continue
            n = copy.tokens.shape[0]
            drafts[i, :n] = copy.tokens
            confidence[i, :n] = copy.rates
            self.copied[i] = (copy.match, n)
        return drafts, confidence.to(drafts.device)

    def record(self, accepted: list[int], verified: int):
        """After verification: `accepted[i]` drafts of row i were accepted, `verified` drafts were checked."""
        for (match, copied), a in zip(self.copied, accepted):
            if copied:
                self.acceptance[match].record(copied, a, verified)


def default_ngram_lookup(device: torch.device) -> int:
    """The fastest setting measured for the device (docs/benchmarks.md, "Longest match for copies"): 6 on CPUs, off
    (0) on accelerators."""
    return 6 if torch.device(device).type == "cpu" else 0


def check_ngram_lookup(value):
    """`value` if it is a valid `drafter.ngram_lookup` (None = the device's default, 0 = off, else the longest
    n-gram to match), else a ValueError."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(
            f"drafter.ngram_lookup={value!r} is not valid: use None (the device's default), 0 (off) or the longest "
            "n-gram to match, e.g. 2."
        )
    return value


def ngram_lookup_for(setting, block_size: int, device: torch.device | str = "cpu") -> NgramLookup | None:
    """The lookup for a `drafter.ngram_lookup` setting, or None when it is off."""
    size = check_ngram_lookup(setting)
    size = default_ngram_lookup(device) if size is None else size
    return NgramLookup(size, block_size) if size else None
