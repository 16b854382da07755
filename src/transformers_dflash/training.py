"""Training a DFlash drafter for a frozen target (the recipe of arXiv 2602.06036, section "Training").

One training step, for every sequence of the batch:

1. the frozen target reads the whole sequence once; the hidden states of `drafter.config.target_layer_ids` are the
   drafter's context features (or they come precomputed with the data: "offline" training);
2. `num_anchors` random anchor positions are drawn among the response tokens; each anchor opens a block
   [clean anchor token, MASK x (block_size - 1)] at positions anchor .. anchor + block_size - 1;
3. all blocks are packed after the context rows and go through the drafter in ONE forward, under a block-sparse
   attention mask: a block sees the context rows strictly before its anchor and its own rows (bidirectionally), never
   another block. So every block computes exactly what it would compute alone at inference time;
4. block slot k (k = 1 .. block_size - 1) predicts token[anchor + k]; the cross-entropy is weighted by
   exp(-(k - 1) / gamma), because a draft is only useful if every draft before it was accepted.

`dflash_loss` is that step; `train` is the loop around it (accelerate, AdamW, cosine schedule, checkpoints that resume
automatically, validation by real speculative decoding); `add_train_arguments` / `run_train` are the CLI
(`dflash train --target ... --data ... --output ...`).

Data format (shared with the data generator)
--------------------------------------------
A data directory holds shards named `shard-00000.pt`, `shard-00001.pt`, ... (five digits, read in sorted order). Each
shard is a `list` of `dict`s written with `torch.save`, one dict per training sequence (prompt + response regenerated
by the target, tokenized with the target's chat template):

- `"input_ids"`: 1-D `torch.long` tensor `[seq_len]`, the tokens of prompt and response;
- `"loss_mask"`: 1-D `torch.bool` tensor `[seq_len]`, True on the response tokens (the ones the drafter learns);
- optional `"context_features"`: `[seq_len, len(target_layer_ids) * hidden_size]` floating tensor, the target's
  features precomputed (offline training); used only when every example of a batch has them.

Other keys are ignored. Shards are loaded with `torch.load(..., weights_only=True)`, so they must hold only tensors,
lists, dicts and plain Python values. `iter_training_examples(data_dir)` reads this format.
"""

import argparse
import contextlib
import copy
import json
import math
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from .modeling_dflash import DFlashDraftModel

SHARD_GLOB = "shard-*.pt"
CHECKPOINT_PREFIX = "checkpoint-"
TRAINING_STATE = "training_state.pt"  # written last: a checkpoint without it is incomplete and ignored


# ------------------------------------------------------------------------------------------------------------------
# Data


def list_shards(data_dir: str | Path) -> list[Path]:
    shards = sorted(Path(data_dir).glob(SHARD_GLOB))
    if not shards:
        raise FileNotFoundError(f"No {SHARD_GLOB} files in {data_dir}; see the data format in transformers_dflash.training.")
    return shards


def load_shard(path: str | Path) -> list[dict]:
    """One shard: a list of {"input_ids": long [S], "loss_mask": bool [S], ...}; checked on load."""
    examples = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(examples, list):
        raise ValueError(f"{path} holds a {type(examples).__name__}; a shard must hold a list of dicts.")
    for i, example in enumerate(examples):
        input_ids, loss_mask = example.get("input_ids"), example.get("loss_mask")
        if (
            not isinstance(input_ids, torch.Tensor)
            or not isinstance(loss_mask, torch.Tensor)
            or input_ids.dim() != 1
            or input_ids.dtype != torch.long
            or loss_mask.dtype != torch.bool
            or loss_mask.shape != input_ids.shape
        ):
            raise ValueError(
                f"Example {i} of {path} does not follow the shard format: it needs 'input_ids' (1-D torch.long) and "
                "'loss_mask' (1-D torch.bool, same length)."
            )
    return examples


def iter_training_examples(data_dir: str | Path):
    """Every example of `data_dir`, shard by shard in sorted order: dicts with `input_ids` and `loss_mask`."""
    for path in list_shards(data_dir):
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
    if all("context_features" in example for example in examples):
        first = examples[0]["context_features"]
        features = first.new_zeros(batch_size, seq_len, first.shape[-1])
        for i, (example, length) in enumerate(zip(examples, lengths)):
            features[i, :length] = example["context_features"][:length]
        batch["context_features"] = features
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


def validation_prompts(data_dir: str | Path, num_examples: int) -> list[torch.Tensor]:
    """The prompts (tokens before the first response token) of the first `num_examples` examples of `data_dir`."""
    prompts = []
    for i, example in enumerate(iter_training_examples(data_dir)):
        if i == num_examples:
            break
        response = example["loss_mask"].nonzero()
        if len(response) and response[0, 0] > 0:
            prompts.append(example["input_ids"][: response[0, 0]])
    return prompts


# ------------------------------------------------------------------------------------------------------------------
# Anchors, the packed-block attention mask and the loss weights


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, block_size: int, generator: torch.Generator | None = None
) -> tuple[torch.LongTensor, torch.BoolTensor]:
    """Random anchor positions among the response positions, without replacement, sorted.

    loss_mask: `[seq_len]` or `[batch, seq_len]` bool, True on response tokens. Candidates are the positions p with
        loss_mask[p] True and p <= seq_len - block_size (the whole block fits in the sequence).
    generator: optional `torch.Generator` on `loss_mask`'s device, for reproducible draws.

    Returns `(anchors, valid)`, both shaped like loss_mask with the last axis replaced by `num_blocks` =
    min(num_anchors, most candidates of any row), at least 1. A row with fewer candidates gets all of them, then
    padding entries: anchor 0 with valid False (they must be ignored by the loss).
    """
    squeeze = loss_mask.dim() == 1
    loss_mask = loss_mask.bool()[None] if squeeze else loss_mask.bool()
    batch, seq_len = loss_mask.shape
    positions = torch.arange(seq_len, device=loss_mask.device)
    candidates = loss_mask & (positions <= seq_len - block_size)
    num_blocks = max(1, min(num_anchors, int(candidates.sum(dim=1).max())))
    # Uniform sampling without replacement: the candidates with the `num_blocks` largest random scores.
    scores = torch.rand(batch, seq_len, device=loss_mask.device, generator=generator)
    scores = scores.masked_fill(~candidates, -1.0)
    chosen = scores.topk(num_blocks, dim=1).indices
    valid = candidates.gather(1, chosen)
    # Sort the valid anchors, padding last.
    anchors = chosen.masked_fill(~valid, seq_len).sort(dim=1).values
    valid = anchors < seq_len
    anchors = anchors.masked_fill(~valid, 0)
    if squeeze:
        return anchors[0], valid[0]
    return anchors, valid


def block_position_ids(anchors: torch.LongTensor, block_size: int) -> torch.LongTensor:
    """Positions of the packed blocks: anchor + 0 .. anchor + block_size - 1 per block, `[batch, num_blocks * block_size]`."""
    offsets = torch.arange(block_size, device=anchors.device)
    return (anchors[:, :, None] + offsets).flatten(1)


def build_block_attention_mask(anchors: torch.LongTensor, seq_len: int, block_size: int) -> torch.BoolTensor:
    """The attention mask of packed blocks, `[batch, 1, num_blocks * block_size, seq_len + num_blocks * block_size]`.

    Keys are [seq_len context rows ; packed block rows] (the drafter's layout); True = may attend. A row of block j sees
    the context positions STRICTLY before anchor j (the anchor itself enters as the block's clean first token) and
    every row of block j, in both directions; it never sees another block.
    """
    batch, num_blocks = anchors.shape
    block_len = num_blocks * block_size
    row_anchor = anchors.repeat_interleave(block_size, dim=1)  # [batch, block_len]
    context_positions = torch.arange(seq_len, device=anchors.device)
    sees_context = context_positions[None, None, :] < row_anchor[:, :, None]  # [batch, block_len, seq_len]
    row_block = torch.arange(block_len, device=anchors.device) // block_size
    sees_block = (row_block[:, None] == row_block[None, :]).expand(batch, block_len, block_len)
    return torch.cat([sees_context, sees_block], dim=2)[:, None]


def default_gamma(block_size: int) -> float:
    """The loss decay of the paper: 4 for block size 8, 5 for 10, 7 for 16.

    Other sizes interpolate linearly between those points and continue the end slopes: block_size / 2 up to 10, then
    5 + (block_size - 10) / 3 (e.g. 2 for 4, 6 for 13, 12.33 for 32).
    """
    if block_size <= 10:
        return block_size / 2
    return 5 + (block_size - 10) / 3


def loss_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """Per-slot weights `[block_size]`: 0 for slot 0 (the anchor), exp(-(k - 1) / gamma) for slot k >= 1."""
    gamma = default_gamma(block_size) if gamma is None else gamma
    slots = torch.arange(block_size, dtype=torch.float32)
    weights = torch.exp(-(slots - 1) / gamma)
    weights[0] = 0.0
    return weights


# ------------------------------------------------------------------------------------------------------------------
# The loss


@torch.no_grad()
def target_context_features(target: nn.Module, input_ids, layer_ids, attention_mask=None) -> torch.Tensor:
    """The drafter's context: the target's hidden_states[i + 1] for i in `layer_ids`, concatenated `[b, S, K * H]`."""
    outputs = target.get_decoder()(
        input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False
    )
    return torch.cat([outputs.hidden_states[i + 1] for i in layer_ids], dim=-1)


def dflash_loss(
    drafter: nn.Module,
    target: nn.Module,
    input_ids: torch.LongTensor,
    loss_mask: torch.BoolTensor,
    num_anchors: int,
    attention_mask: torch.Tensor | None = None,
    context_features: torch.Tensor | None = None,
    gamma: float | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict]:
    """The DFlash training loss of a batch: random anchored blocks, one packed drafter forward, weighted cross-entropy.

    drafter: the `DFlashDraftModel` (possibly wrapped by DDP: its forward is what gets called).
    target: the frozen target; its embeddings embed the blocks and its `lm_head` gives the logits. It runs only when
        `context_features` is None.
    input_ids `[b, S]`, loss_mask `[b, S]` (True on response tokens), attention_mask `[b, S]` (None = no padding).
    context_features `[b, S, K * H]`: precomputed `target_context_features` (offline training), else computed here.
    gamma: loss decay over block slots (default `default_gamma(block_size)`).
    generator: random source of the anchors (`torch.Generator` on the batch's device).

    Returns `(loss, metrics)`; metrics are detached tensors: `loss`, `accuracy` (top-1 over labelled slots),
    `slot_accuracy` `[block_size - 1]` (slots 1 ..), `acceptance_length` (a proxy of tau: 1 + the mean number of
    leading slots of a block that are all right, a slot without label counting as wrong), `num_blocks`, `num_labels`.
    """
    unwrapped = getattr(drafter, "module", drafter)
    config = unwrapped.config
    if config._attn_implementation == "flash_attention_2":
        raise ValueError("FlashAttention-2 cannot apply the packed-block mask; train the drafter with 'sdpa' or 'eager'.")
    block_size = config.block_size
    batch, seq_len = input_ids.shape
    device = input_ids.device
    dtype = unwrapped.fc.weight.dtype

    if context_features is None:
        context_features = target_context_features(target, input_ids, config.target_layer_ids, attention_mask)

    # Blocks: [clean anchor token, MASK x (block_size - 1)] at positions anchor .. anchor + block_size - 1.
    anchors, anchor_valid = sample_anchors(loss_mask, num_anchors, block_size, generator)  # [b, n]
    num_blocks = anchors.shape[1]
    block_ids = torch.full((batch, num_blocks, block_size), config.mask_token_id, dtype=torch.long, device=device)
    block_ids[:, :, 0] = input_ids.gather(1, anchors)
    with torch.no_grad():
        block_embeddings = target.get_input_embeddings()(block_ids.flatten(1))

    hidden = drafter(
        block_embeddings=block_embeddings.to(dtype),
        context_features=context_features.to(dtype),
        block_position_ids=block_position_ids(anchors, block_size),
        context_position_ids=torch.arange(seq_len, device=device).expand(batch, seq_len),
        attention_mask=build_block_attention_mask(anchors, seq_len, block_size),
    ).last_hidden_state.view(batch, num_blocks, block_size, -1)

    # Labels: slot k of a block predicts token[anchor + k]; it counts if that token is a response token.
    slots = torch.arange(block_size, device=device)
    label_positions = (anchors[:, :, None] + slots).clamp(max=seq_len - 1).flatten(1)
    labels = input_ids.gather(1, label_positions).view(batch, num_blocks, block_size)
    labelled = loss_mask.gather(1, label_positions).view(batch, num_blocks, block_size)
    labelled = labelled & anchor_valid[:, :, None] & (slots > 0)

    # Weighted cross-entropy over the labelled slots only (the LM head is the expensive part: skip the rest).
    lm_head = target.get_output_embeddings()
    head_dtype = lm_head.weight.dtype
    logits = lm_head(hidden[labelled].to(head_dtype))  # [num_labels, vocab]
    logits = logits.float() if logits.element_size() < 4 else logits  # cross-entropy in float32 at least
    targets = labels[labelled]
    weights = loss_weights(block_size, gamma).to(device).expand_as(labelled)[labelled]
    token_losses = F.cross_entropy(logits, targets, reduction="none")
    loss = (token_losses * weights).sum() / weights.sum().clamp(min=1e-8)

    with torch.no_grad():
        correct = logits.argmax(dim=-1) == targets
        slot_of_label = slots.expand_as(labelled)[labelled]
        slot_counts = torch.bincount(slot_of_label, minlength=block_size)[1:]
        slot_correct = torch.bincount(slot_of_label, weights=correct.float(), minlength=block_size)[1:]
        correct_grid = torch.zeros_like(labelled)
        correct_grid[labelled] = correct
        accepted = correct_grid[:, :, 1:].long().cumprod(dim=-1).sum(dim=-1)  # [b, n], 0 for padding blocks
        num_valid_blocks = anchor_valid.sum()
        metrics = {
            "loss": loss.detach(),
            "accuracy": correct.float().sum() / max(len(correct), 1),
            "slot_accuracy": slot_correct / slot_counts.clamp(min=1),
            "acceptance_length": 1 + accepted.sum() / num_valid_blocks.clamp(min=1),
            "num_blocks": num_valid_blocks,
            "num_labels": labelled.sum(),
        }
    return loss, metrics


# ------------------------------------------------------------------------------------------------------------------
# Validation: real speculative decoding


@torch.no_grad()
def evaluate_acceptance_length(
    target: nn.Module, drafter: nn.Module, prompts: list[torch.Tensor], max_new_tokens: int = 128
) -> float:
    """Mean acceptance length (tau, bonus token included) of greedy DFlash decoding over `prompts` (1-D id tensors).

    Pools every verification step of every prompt: total tokens gained / number of target forwards (prefill excluded).
    When the drafter's dtype or device differs from the target's (fp32 master weights of a bf16 target), a converted
    copy decodes: `generate()` would otherwise move the drafter being trained.
    """
    target_param, drafter_param = next(target.parameters()), next(drafter.parameters())
    if (drafter_param.dtype, drafter_param.device) != (target_param.dtype, target_param.device):
        drafter = copy.deepcopy(drafter).to(device=target_param.device, dtype=target_param.dtype)
    was_training = drafter.training
    drafter.eval()
    steps = []
    try:
        for prompt in prompts:
            input_ids = prompt.to(target_param.device)[None]
            target.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                assistant_model=drafter,
                max_new_tokens=max_new_tokens,
                do_sample=False,
            )
            steps.extend(drafter.last_acceptance_lengths[1:])  # entry 0 is the prefill's token
    finally:
        drafter.train(was_training)
    return sum(steps) / len(steps) if steps else float("nan")


# ------------------------------------------------------------------------------------------------------------------
# The training loop


@dataclass
class TrainingConfig:
    target: str = "smollm2"  # a path / hub id for AutoModelForCausalLM, or "smollm2"
    data: str = "data"  # directory of shard-XXXXX.pt files
    output: str = "dflash-drafter"  # checkpoints, the final drafter and log.jsonl
    val_data: str | None = None  # validation prompts; default: the first num_val_prompts training examples (held out)
    # drafter
    num_layers: int = 5
    block_size: int = 16
    mask_token_id: int | None = None
    target_layer_ids: list[int] | None = None
    num_target_features: int = 5
    # loss
    num_anchors: int = 512
    gamma: float | None = None
    max_length: int = 2048
    # optimisation
    batch_size: int = 1
    grad_accum: int = 1
    epochs: float = 6
    max_steps: int | None = None  # overrides epochs
    lr: float = 6e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    grad_clip: float = 1.0
    mixed_precision: str = "no"  # "no", "bf16" or "fp16" (autocast; the drafter's weights stay float32)
    target_dtype: str = "auto"  # "auto" (bfloat16 on GPU, float32 on CPU), "bfloat16", "float16", "float32"
    # bookkeeping
    save_every: int = 1000
    keep_checkpoints: int = 2
    eval_every: int = 1000
    num_val_prompts: int = 8
    val_max_new_tokens: int = 128
    log_every: int = 10
    seed: int = 0


def load_target(name_or_path: str, dtype: torch.dtype) -> nn.Module:
    """The target model: `transformers_dflash.smollm2.load_smollm2()` for "smollm2", else AutoModelForCausalLM."""
    if name_or_path == "smollm2":
        from .smollm2 import load_smollm2

        loaded = load_smollm2()
        target = loaded[0] if isinstance(loaded, tuple) else loaded  # (model, tokenizer) or model
        return target.to(dtype)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step in `output_dir`, if any."""
    found = []
    for path in Path(output_dir).glob(CHECKPOINT_PREFIX + "*"):
        match = re.fullmatch(CHECKPOINT_PREFIX + r"(\d+)", path.name)
        if match and (path / TRAINING_STATE).exists():
            found.append((int(match.group(1)), path))
    return max(found)[1] if found else None


def save_checkpoint(accelerator, output_dir, step, drafter, optimizer, scheduler, anchor_generator, keep):
    """checkpoint-<step>/: the drafter (save_pretrained), optimizer.pt, rng-<rank>.pt and, last, training_state.pt."""
    path = Path(output_dir) / f"{CHECKPOINT_PREFIX}{step:08d}"
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        accelerator.unwrap_model(drafter).save_pretrained(path)
        torch.save(optimizer.state_dict(), path / "optimizer.pt")
    path.mkdir(parents=True, exist_ok=True)
    rng = {"anchors": anchor_generator.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, path / f"rng-{accelerator.process_index}.pt")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        scaler = accelerator.scaler.state_dict() if accelerator.scaler is not None else None
        torch.save({"step": step, "scheduler": scheduler.state_dict(), "scaler": scaler}, path / TRAINING_STATE)
        checkpoints = sorted(Path(output_dir).glob(CHECKPOINT_PREFIX + "*"))
        for old in checkpoints[: max(len(checkpoints) - max(keep, 1), 0)]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()


def load_checkpoint(accelerator, path, optimizer, scheduler, anchor_generator) -> int:
    """Restore what `save_checkpoint` wrote (the drafter is loaded separately, before `prepare`); return the step."""
    state = torch.load(path / TRAINING_STATE, weights_only=True)
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True))
    scheduler.load_state_dict(state["scheduler"])
    if accelerator.scaler is not None and state["scaler"] is not None:
        accelerator.scaler.load_state_dict(state["scaler"])
    rng = torch.load(path / f"rng-{accelerator.process_index}.pt", weights_only=True)
    anchor_generator.set_state(rng["anchors"])
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return state["step"]


def train(config: TrainingConfig, target: nn.Module | None = None) -> dict:
    """Train a DFlash drafter for `target` (default: `load_target(config.target)`) on the shards in `config.data`.

    Resumes from the latest checkpoint in `config.output` when there is one. The same code runs on one CPU and under
    `accelerate launch` on several GPUs (DDP). Returns a summary: final step, the step it resumed from, the last
    logged metrics and the last validation acceptance length.
    """
    from accelerate import Accelerator
    from tqdm.auto import tqdm
    from transformers import get_cosine_schedule_with_warmup

    accelerator = Accelerator(mixed_precision=config.mixed_precision)
    device = accelerator.device
    output_dir = Path(config.output)
    output_dir.mkdir(parents=True, exist_ok=True)
    log_path = output_dir / "log.jsonl"

    def log(record):
        if accelerator.is_main_process:
            with open(log_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    # Target: frozen.
    if target is None:
        names = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32}
        dtype = names.get(config.target_dtype) or getattr(torch, config.target_dtype)
        target = load_target(config.target, dtype)
    target.requires_grad_(False)
    target.eval()
    target.to(device)

    # Drafter: from the latest checkpoint, or freshly initialised (same seed on every process). Float32 weights.
    checkpoint = latest_checkpoint(output_dir)
    torch.manual_seed(config.seed)
    if checkpoint is not None:
        drafter = DFlashDraftModel.from_pretrained(checkpoint, dtype=torch.float32)
    else:
        drafter = DFlashDraftModel.from_target(
            target,
            num_layers=config.num_layers,
            block_size=config.block_size,
            mask_token_id=config.mask_token_id,
            target_layer_ids=config.target_layer_ids,
            num_target_features=config.num_target_features,
        )
    drafter.float().train()
    if drafter.config._attn_implementation in (None, "flash_attention_2"):
        drafter.config._attn_implementation = "sdpa"  # FlashAttention-2 cannot express the packed-block mask

    # Data: the first num_val_prompts examples are held out for validation unless val_data is given.
    shards = list_shards(config.data)
    shard_sizes = [len(load_shard(path)) for path in shards]
    shard_offsets = [sum(shard_sizes[:i]) for i in range(len(shards))]
    held_out = 0 if config.val_data else config.num_val_prompts
    num_examples = sum(shard_sizes) - held_out
    prompts = validation_prompts(config.val_data or config.data, config.num_val_prompts)
    batches_per_epoch = num_examples // accelerator.num_processes // config.batch_size
    total_steps = config.max_steps or math.ceil(config.epochs * batches_per_epoch / config.grad_accum)
    if total_steps <= 0:
        raise ValueError(f"Nothing to train: {num_examples} examples give {batches_per_epoch} batches per epoch.")

    optimizer = torch.optim.AdamW(drafter.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    # The schedule counts optimizer steps and is stepped by hand, once per step (not prepared by accelerate).
    scheduler = get_cosine_schedule_with_warmup(optimizer, math.ceil(config.warmup_ratio * total_steps), total_steps)
    drafter, optimizer = accelerator.prepare(drafter, optimizer)
    anchor_generator = torch.Generator(device=device)
    anchor_generator.manual_seed(config.seed + accelerator.process_index)

    step = 0
    if checkpoint is not None:
        step = load_checkpoint(accelerator, checkpoint, optimizer, scheduler, anchor_generator)
        accelerator.print(f"Resumed from {checkpoint} (step {step}).")
    summary = {"resumed_from": step if checkpoint is not None else None, "val_acceptance_length": None}
    log({"event": "start", "step": step, "total_steps": total_steps, "config": asdict(config)})

    batches = training_batches(
        shards, shard_offsets, num_examples, config.batch_size, config.max_length, config.seed,
        rank=accelerator.process_index, world_size=accelerator.num_processes, skip_below=held_out,
        start_batch=step * config.grad_accum,
    )

    def validate():
        if accelerator.is_main_process and prompts:
            tau = evaluate_acceptance_length(
                target, accelerator.unwrap_model(drafter), prompts, config.val_max_new_tokens
            )
            summary["val_acceptance_length"] = tau
            log({"step": step, "val_acceptance_length": tau})
            progress.write(f"step {step}: validation acceptance length {tau:.3f} on {len(prompts)} prompts")
        accelerator.wait_for_everyone()

    progress = tqdm(total=total_steps, initial=step, desc="train", disable=not accelerator.is_main_process)
    train_time, train_tokens = 0.0, 0
    loss_sum, steps_since_log = torch.zeros((), device=device), 0
    while step < total_steps:
        start = time.perf_counter()
        step_tokens = 0
        for micro_step in range(config.grad_accum):
            batch = {k: v.to(device) if v is not None else None for k, v in next(batches).items()}
            step_tokens += batch["input_ids"].numel() if batch["attention_mask"] is None else int(batch["attention_mask"].sum())
            # Gradients are all-reduced across processes on the last micro-batch only.
            is_last = micro_step == config.grad_accum - 1
            sync_context = contextlib.nullcontext() if is_last else accelerator.no_sync(drafter)
            with sync_context, accelerator.autocast():
                loss, metrics = dflash_loss(
                    drafter, target, batch["input_ids"], batch["loss_mask"], config.num_anchors,
                    attention_mask=batch["attention_mask"], context_features=batch["context_features"],
                    gamma=config.gamma, generator=anchor_generator,
                )
                accelerator.backward(loss / config.grad_accum)
            loss_sum += metrics["loss"] / config.grad_accum
        grad_norm = accelerator.clip_grad_norm_(drafter.parameters(), config.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        steps_since_log += 1

        train_time += time.perf_counter() - start
        train_tokens += step_tokens * accelerator.num_processes
        progress.update(1)
        if step % config.log_every == 0 or step == total_steps:
            record = {
                "step": step,
                "loss": accelerator.reduce(loss_sum, reduction="mean").item() / steps_since_log,
                "accuracy": metrics["accuracy"].item(),
                "acceptance_length": metrics["acceptance_length"].item(),
                "slot_accuracy": [round(a, 4) for a in metrics["slot_accuracy"].tolist()],
                "lr": scheduler.get_last_lr()[0],
                "grad_norm": float(grad_norm),
                "tokens_per_second": train_tokens / train_time,
            }
            loss_sum.zero_()
            steps_since_log = 0
            log(record)
            summary.update(record)
            progress.set_postfix(
                loss=f"{record['loss']:.3f}", acc=f"{record['accuracy']:.3f}",
                tau=f"{record['acceptance_length']:.2f}", tok_s=f"{record['tokens_per_second']:.0f}",
            )
        if step % config.save_every == 0 or step == total_steps:
            save_checkpoint(
                accelerator, output_dir, step, drafter, optimizer, scheduler, anchor_generator, config.keep_checkpoints
            )
        if step % config.eval_every == 0 or step == total_steps:
            validate()
    progress.close()

    if accelerator.is_main_process:
        accelerator.unwrap_model(drafter).save_pretrained(output_dir)
    accelerator.wait_for_everyone()
    summary["step"] = step
    return summary


# ------------------------------------------------------------------------------------------------------------------
# CLI


def add_train_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of `dflash train`; their names are the fields of `TrainingConfig`."""
    d = TrainingConfig()
    parser.add_argument("--target", default=d.target, help='target model path or hub id, or "smollm2"')
    parser.add_argument("--data", required=True, help="directory of shard-XXXXX.pt files (see transformers_dflash.training)")
    parser.add_argument("--output", required=True, help="checkpoints, final drafter, log.jsonl; resumes from here")
    parser.add_argument("--val-data", default=None, help="shard directory of validation prompts (default: hold out training examples)")
    parser.add_argument("--num-layers", type=int, default=d.num_layers, help="drafter layers")
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument("--mask-token-id", type=int, default=None, help="default: last row of the target's embeddings")
    parser.add_argument("--target-layer-ids", type=int, nargs="+", default=None, help="default: DFlash's spread")
    parser.add_argument("--num-target-features", type=int, default=d.num_target_features)
    parser.add_argument("--num-anchors", type=int, default=d.num_anchors, help="blocks per sequence")
    parser.add_argument("--gamma", type=float, default=None, help="loss decay (default: 7 for block 16, 5 for 10, 4 for 8)")
    parser.add_argument("--max-length", type=int, default=d.max_length, help="truncate sequences to this many tokens")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per process and micro-batch")
    parser.add_argument("--grad-accum", type=int, default=d.grad_accum, help="micro-batches per optimizer step")
    parser.add_argument("--epochs", type=float, default=d.epochs)
    parser.add_argument("--max-steps", type=int, default=None, help="optimizer steps (overrides --epochs)")
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--weight-decay", type=float, default=d.weight_decay)
    parser.add_argument("--warmup-ratio", type=float, default=d.warmup_ratio)
    parser.add_argument("--grad-clip", type=float, default=d.grad_clip)
    parser.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], default=d.mixed_precision)
    parser.add_argument("--target-dtype", choices=["auto", "bfloat16", "float16", "float32"], default=d.target_dtype)
    parser.add_argument("--save-every", type=int, default=d.save_every, help="checkpoint every N optimizer steps")
    parser.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints)
    parser.add_argument("--eval-every", type=int, default=d.eval_every, help="validate every N optimizer steps")
    parser.add_argument("--num-val-prompts", type=int, default=d.num_val_prompts)
    parser.add_argument("--val-max-new-tokens", type=int, default=d.val_max_new_tokens)
    parser.add_argument("--log-every", type=int, default=d.log_every)
    parser.add_argument("--seed", type=int, default=d.seed)
    return parser


def run_train(args: argparse.Namespace) -> dict:
    """`dflash train`: build a `TrainingConfig` from parsed `add_train_arguments` options and train."""
    config = TrainingConfig(**{f.name: getattr(args, f.name) for f in fields(TrainingConfig) if hasattr(args, f.name)})
    return train(config)
