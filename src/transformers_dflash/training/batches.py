"""Training data: examples from the shards, shuffled epochs, collation into padded batches, the validation
prompts and the draft vocabulary."""

import os
import random
from collections.abc import Sequence
from pathlib import Path

import torch

from ..data import DataError, list_shards, load_shard


def data_folders(data: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """The folders of `--data`: one, or several that are trained on as one dataset (in the order given)."""
    folders = [Path(data)] if isinstance(data, (str, os.PathLike)) else [Path(folder) for folder in data]
    if not folders:
        raise ValueError("No --data folder given: name one or more folders of shards.")
    seen = {}
    for folder in folders:
        if folder.resolve() in seen:
            raise ValueError(
                f"--data names {seen[folder.resolve()]} twice (as {folder} too): its examples would count double. "
                "Name each folder once."
            )
        seen[folder.resolve()] = folder
    return folders


def training_shards(data: str | os.PathLike | Sequence[str | os.PathLike]) -> list[tuple[Path, list[Path]]]:
    """Each folder of `data` with its shard files, in shard order; a folder without shards is refused."""
    found = [(folder, list_shards(folder)) for folder in data_folders(data)]
    for folder, shards in found:
        if not shards:
            raise DataError(
                f"{folder} holds no shard-XXXXX.parquet or .pt files. Point --data at the --out folder of "
                "`dflash regenerate` or `dflash features`."
            )
    return found


def iter_training_examples(data: str | os.PathLike | Sequence[str | os.PathLike]):
    """Every example of `data` (one folder or several), shard by shard in order: dicts with `input_ids` and
    `loss_mask`."""
    for _, shards in training_shards(data):
        for path in shards:
            yield from load_shard(path)


def epoch_examples(shards: list[Path], shard_offsets: list[int], seed: int, skip_below: int = 0):
    """The examples of one epoch in a shuffled order: shards in a random order, each shard shuffled.

    Examples whose index in the unshuffled order is below `skip_below` are left out (the held-out validation set).
    """
    rng = random.Random(seed)
    shard_order = list(range(len(shards)))
    rng.shuffle(shard_order)
    for s in shard_order:
        examples = load_shard(shards[s])
        indices = [i for i in range(len(examples)) if shard_offsets[s] + i >= skip_below]
        rng.shuffle(indices)
        for i in indices:
            yield examples[i]


def collate(examples: list[dict], max_length: int) -> dict:
    """Right-pad a list of examples (truncated to `max_length`) into a batch.

    `attention_mask` is None when nothing is padded. Padding has `loss_mask` False, so it is never an anchor or a label.
    """
    lengths = [min(len(example["input_ids"]), max_length) for example in examples]
    batch_size, seq_len = len(examples), max(lengths)
    input_ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
    loss_mask = torch.zeros(batch_size, seq_len, dtype=torch.bool)
    attention_mask = torch.zeros(batch_size, seq_len, dtype=torch.long)
    for i, (example, length) in enumerate(zip(examples, lengths)):
        input_ids[i, :length] = example["input_ids"][:length]
        loss_mask[i, :length] = example["loss_mask"][:length]
        attention_mask[i, :length] = 1
    batch = {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "attention_mask": None if min(lengths) == seq_len else attention_mask,
        "context_features": None,
    }
    if all("target_ids" in example for example in examples):  # the target's choices, cached by `dflash features`
        batch["target_ids"] = input_ids.clone()
        for i, (example, length) in enumerate(zip(examples, lengths)):
            batch["target_ids"][i, :length] = example["target_ids"][:length]
    # Per-position vectors cached by `dflash features` (the top tokens with --top-k); padding is zeros, never labelled.
    for name in ("context_features", "target_top_ids", "target_top_logprobs"):
        if all(name in example for example in examples):
            first = examples[0][name]
            batch[name] = first.new_zeros(batch_size, seq_len, first.shape[-1])
            for i, (example, length) in enumerate(zip(examples, lengths)):
                batch[name][i, :length] = example[name][:length]
    return batch


def training_batches(
    shards, shard_offsets, num_examples, batch_size, max_length, seed, rank=0, world_size=1, skip_below=0, start_batch=0
):
    """Endless stream of this process's batches, epoch after epoch, starting at batch number `start_batch`.

    Epoch e is shuffled with seed `seed + e`. Each process takes every `world_size`-th example; the tail that does not
    fill a batch on every process is dropped, so all processes run the same number of batches per epoch. The stream is
    a pure function of its arguments: a resumed run skips the `start_batch` batches it already trained on.
    """
    per_process = num_examples // world_size
    batches_per_epoch = per_process // batch_size
    if batches_per_epoch == 0:
        raise ValueError(
            f"{num_examples} training examples cannot fill a batch of {batch_size} on each of {world_size} processes."
        )
    epoch, skip = divmod(start_batch, batches_per_epoch)
    while True:
        examples = epoch_examples(shards, shard_offsets, seed + epoch, skip_below)
        mine = (example for i, example in enumerate(examples) if i % world_size == rank)
        for b in range(batches_per_epoch):
            chunk = [next(mine) for _ in range(batch_size)]
            if b >= skip:
                yield collate(chunk, max_length)
        epoch, skip = epoch + 1, 0


def validation_prompts(data, num_examples: int) -> list[torch.Tensor]:
    """The prompts (tokens before the first response token) of the first `num_examples` examples of `data`."""
    prompts = []
    for i, example in enumerate(iter_training_examples(data)):
        if i == num_examples:
            break
        response = example["loss_mask"].nonzero()
        if len(response) and response[0, 0] > 0:
            prompts.append(example["input_ids"][: response[0, 0]])
    return prompts


def draft_vocabulary(data, size: int, vocab_size: int, exclude=()) -> torch.LongTensor:
    """The `size` most frequent response tokens of the shards in `data` (ties: lower id first), sorted by id.

    A reduced draft vocabulary (EAGLE-3's trick): the drafter scores only these rows of the LM head, which makes its
    step and its training several times cheaper, and loses only the drafts of rare tokens. `exclude` (e.g. the mask
    token) is never chosen. Tokens never seen in a response fill the remaining rows by id.
    """
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for example in iter_training_examples(data):
        response = example["input_ids"][example["loss_mask"].bool()]
        counts += torch.bincount(response, minlength=vocab_size)[:vocab_size].double()
    # Tie-break by id: subtract a tiny multiple of the id (counts are integers, so this never reorders them).
    scores = counts - torch.arange(vocab_size, dtype=torch.float64) / (2.0 * vocab_size)
    for token in exclude:
        if token is not None:
            scores[int(token)] = -float("inf")
    if size > vocab_size - sum(1 for t in set(exclude) if t is not None):
        raise ValueError(f"A draft vocabulary of {size} tokens does not fit a vocabulary of {vocab_size}.")
    return scores.topk(size).indices.sort().values
