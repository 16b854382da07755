"""From the target's verification logits to committed tokens (part of the carried core: torch and transformers only).

Logits processors over every verified position at once, the target's choice at each position, the accepted length of
each row's drafts, and the stopping criteria applied token by token, so a stop inside a block ends a row exactly
where plain `generate()` would.
"""

import torch
from torch import nn
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

# Logits processors that read only the scores, never the input ids: they can run on all verified positions at once.
SCORE_ONLY_PROCESSORS = {
    "TemperatureLogitsWarper",
    "TopKLogitsWarper",
    "TopPLogitsWarper",
    "MinPLogitsWarper",
    "TypicalLogitsWarper",
    "EpsilonLogitsWarper",
    "EtaLogitsWarper",
}


def process_logits(logits_processor, sequences, active, lengths, candidates, logits):
    """Processed scores of every verified position, as plain `generate()` would compute them one token at a time.

    sequences `[batch, max_len]`: committed tokens (left-padded prompt first) of every ORIGINAL row; active: the
    original row of each active row; lengths: committed tokens per original row (host ints); candidates
    `[rows, n]`: [anchor, drafts]; logits `[rows, n, vocab]` (float32). Position i of active row a is processed with
    the ids `sequences[r, :lengths[r]] + candidates[a, 1:i + 1]`, the prefix it would have had in plain decoding.
    Processors are built for the whole batch (some keep per-row settings), so each call sees `batch` rows: all the
    real rows when they are in step, else copies of the one row being processed.
    """
    if not logits_processor:
        return logits
    rows, n, vocab = logits.shape
    if all(type(p).__name__ in SCORE_ONLY_PROCESSORS for p in logits_processor):
        flat = logits_processor(candidates.reshape(-1, 1), logits.reshape(-1, vocab))
        return flat.view(rows, n, vocab)
    batch = sequences.shape[0]
    processed = torch.empty_like(logits)
    in_step = rows == batch and len({lengths[r] for r in active}) == 1 and active == list(range(batch))
    for i in range(n):
        if in_step:
            ids = torch.cat([sequences[:, : lengths[0]], candidates[:, 1 : i + 1]], dim=1)
            processed[:, i] = logits_processor(ids, logits[:, i].clone())
            continue
        for a, r in enumerate(active):
            ids = torch.cat([sequences[r, : lengths[r]], candidates[a, 1 : i + 1]])
            scores = logits[a, i].expand(batch, vocab).clone()
            processed[a, i] = logits_processor(ids.expand(batch, -1), scores)[r]
    return processed


def stop_lengths(stopping_criteria, sequences, active, lengths, new_tokens, num_new, eos_token_id):
    """How many of each row's `num_new` candidate tokens to commit, and whether the row stops there.

    Applies the stopping criteria after each token, as plain `generate()` does, so a stop inside a block ends the row
    on that token. EOS and max length are handled with tensor ops; other criteria (stop strings, custom ones) are
    called on each prefix (with `sequences`/`active`/`lengths` as in `process_logits`).
    """
    rows, width = new_tokens.shape
    offsets = torch.arange(width, device=new_tokens.device)
    stopped = torch.zeros(rows, dtype=torch.bool, device=new_tokens.device)
    if eos_token_id is not None:
        is_eos = torch.isin(new_tokens, eos_token_id.to(new_tokens.device)) & (offsets < num_new[:, None])
        first_eos = torch.where(is_eos, offsets, width).min(dim=1).values
        stopped = first_eos < width
        num_new = torch.where(stopped, first_eos + 1, num_new)
    num_new_host, stopped_host = num_new.tolist(), stopped.tolist()  # the step's one host sync
    others = [c for c in stopping_criteria if not isinstance(c, (EosTokenCriteria, MaxLengthCriteria))]
    if others:
        batch = sequences.shape[0]
        for a, r in enumerate(active):
            for j in range(1, num_new_host[a] + 1):
                ids = torch.cat([sequences[r, : lengths[r]], new_tokens[a, :j]]).expand(batch, -1)
                if any(bool(c(ids, None)[r]) for c in others):
                    num_new_host[a], stopped_host[a] = j, True
                    break
    return num_new_host, stopped_host


def align_continuing_rows(num_new: list[int], stopped: list[bool], budgets: list[int]) -> list[int]:
    """Cut every continuing row to the smallest number of new tokens among them (rows that end keep theirs).

    Committing fewer verified tokens than accepted is always correct: the row simply drafts again from there.
    """
    continuing = [i for i, k in enumerate(num_new) if not stopped[i] and k < budgets[i]]
    if not continuing:
        return num_new
    least = min(num_new[i] for i in continuing)
    return [least if i in continuing else k for i, k in enumerate(num_new)]


def choose_tokens(processed: torch.Tensor, do_sample: bool) -> torch.LongTensor:
    """The target's choice at every position: argmax, or one sample per position of softmax(processed)."""
    if not do_sample:
        return processed.argmax(dim=-1)
    probs = nn.functional.softmax(processed, dim=-1)
    return torch.multinomial(probs.view(-1, probs.shape[-1]), num_samples=1).view(probs.shape[:-1])


def accept_lengths(drafts: torch.LongTensor, choices: torch.LongTensor) -> torch.LongTensor:
    """Per row, the length of the longest prefix of `drafts` `[rows, k]` equal to the target's `choices` `[rows, k + 1]`."""
    return (drafts == choices[:, :-1]).long().cumprod(dim=1).sum(dim=1)
