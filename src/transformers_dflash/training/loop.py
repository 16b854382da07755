"""The training loop: `TrainingConfig`, loading the target, checkpoints that resume automatically, and `train()`."""

import contextlib
import json
import math
import re
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn

from ..kernels import bfloat16_is_fast
from ..modeling_dflash import DFlashDraftModel
from ..target_model import check_drafter_fits_target
from .batches import draft_vocabulary, iter_training_examples, training_batches, training_shards, validation_prompts
from .features import DEFAULT_TOP_K, check_cached_features, check_replay_features, has_top_tokens, shard_sizes
from .loss import check_label_rule, dflash_loss
from .target_init import init_from_target_layers
from .validation import evaluate_acceptance_length, replay_acceptance

# The shape of a drafter trained from scratch, where TrainingConfig leaves it unset.
DRAFTER_DEFAULTS = {"num_layers": 5, "block_size": 16, "num_target_features": 5}
CHECKPOINT_PREFIX = "checkpoint-"
TRAINING_STATE = "training_state.pt"  # written last: a checkpoint without it is incomplete and ignored
# Half cross-entropy, half KL: +0.009 held-out tau over cross-entropy alone for 6 % more CPU per step (docs/training.md,
# "KL distillation on 1,148 new answers").
DEFAULT_KL_WEIGHT = 0.5


@dataclass
class TrainingConfig:
    target: str = "smollm2"  # a path / hub id for AutoModelForCausalLM, or "smollm2"
    data: str | list[str] = "data"  # folder(s) of shard-XXXXX.parquet / .pt files; several are one dataset
    output: str = "dflash-drafter"  # checkpoints, the final drafter and log.jsonl
    val_data: str | None = None  # validation prompts; default: the first num_val_prompts training examples (held out)
    # features folder(s) of the target's greedy answers to held-out prompts: validation also replays decoding on them
    val_features: str | list[str] | None = None
    # drafter: its shape (None: the init_drafter's, else the DRAFTER_DEFAULTS), or the drafter to fine-tune
    num_layers: int | None = None
    block_size: int | None = None
    mask_token_id: int | None = None
    target_layer_ids: list[int] | None = None
    num_target_features: int | None = None
    draft_vocab_size: int | None = None  # reduced draft vocabulary: the most frequent response tokens of the data
    init_drafter: str | None = None  # start from this trained drafter's weights (a folder) instead of random ones
    init_from_target: bool = False  # start a new drafter's layers from the target's last layers (target_init.py)
    # loss
    num_anchors: int = 512
    gamma: float | None = None
    labels: str = "auto"  # "target": the target's own choices (see loss.py), "text": the data's tokens
    # share of KL(target || drafter) in the loss (distillation; see loss.py). None: DEFAULT_KL_WEIGHT where the target's
    # top tokens are at hand (features cached with them, or the target running online), else 0
    kl_weight: float | None = None
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
    # "auto" (bf16 where bfloat16 is fast: a GPU that has it, a CPU with AMX or AVX512-BF16; else "no"), "no", "bf16"
    # or "fp16" (autocast; the drafter's weights and optimiser state stay float32)
    mixed_precision: str = "auto"
    target_dtype: str = "auto"  # "auto" (bfloat16 on GPU, float32 on CPU), "bfloat16", "float16", "float32"
    # bookkeeping
    save_every: int = 1000
    keep_checkpoints: int = 2
    eval_every: int = 1000
    num_val_prompts: int = 8
    val_max_new_tokens: int = 128
    log_every: int = 10
    seed: int = 0


def target_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype the frozen target runs in: "auto" is bfloat16 on a GPU and float32 on a CPU, else the named dtype."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def autocast_precision(name: str) -> str:
    """The `Accelerator` mixed precision for `TrainingConfig.mixed_precision`: "auto" is "bf16" where bfloat16 is fast
    on the device accelerate will pick (a CUDA GPU with bfloat16, a CPU with AMX or AVX512-BF16, where it trained
    faster to the same held-out tau: docs/training.md), else "no"."""
    if name != "auto":
        return name
    return "bf16" if bfloat16_is_fast("cuda" if torch.cuda.is_available() else "cpu") else "no"


def load_target(name_or_path: str, dtype: torch.dtype) -> nn.Module:
    """The target model: `transformers_dflash.smollm2.load_smollm2()` for "smollm2", else AutoModelForCausalLM."""
    if name_or_path == "smollm2":
        from ..smollm2 import load_smollm2

        target, _ = load_smollm2(dtype=dtype)
        return target
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype)


def load_init_drafter(config: TrainingConfig, target: nn.Module) -> DFlashDraftModel:
    """The drafter at `config.init_drafter`, in float32, to fine-tune: it keeps its own shape and draft vocabulary, so
    a shape option of `config` that says otherwise is refused rather than silently ignored."""
    folder = Path(config.init_drafter)
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"--init-drafter {folder}: no drafter there (no config.json). Pass the folder of a trained drafter, as "
            "`dflash train` or `dflash export` writes it, or leave --init-drafter out to train from scratch."
        )
    drafter = DFlashDraftModel.from_pretrained(folder, dtype=torch.float32)
    check_drafter_fits_target(drafter, target)
    c = drafter.config
    has = {
        "num_layers": c.num_hidden_layers,
        "block_size": c.block_size,
        "num_target_features": len(c.target_layer_ids),
        "target_layer_ids": list(c.target_layer_ids),
        "mask_token_id": c.mask_token_id,
        "draft_vocab_size": c.draft_vocab_size,
    }
    for name, value in has.items():
        asked = getattr(config, name)
        if asked is not None and asked != value:
            option = "--" + name.replace("_", "-")
            raise ValueError(
                f"{option} {asked}, but the drafter in {folder} has {name} = {value}, and fine-tuning keeps the "
                f"drafter's shape. Leave {option} out (or set it to {value}), or train from scratch without "
                "--init-drafter."
            )
    return drafter


def resolve_kl_weight(kl_weight: float | None, folders: list[str | Path]) -> tuple[float, str | None]:
    """`TrainingConfig.kl_weight` as trained with, and a note when None falls back to 0: `DEFAULT_KL_WEIGHT` where
    every training folder has the target's top tokens at hand (`has_top_tokens`), else 0 (hard labels only)."""
    if kl_weight is not None:
        return kl_weight, None
    without = [str(folder) for folder in folders if not has_top_tokens(folder)]
    if not without:
        return DEFAULT_KL_WEIGHT, None
    return 0.0, (
        f"Training on hard labels alone (--kl-weight 0): the features in {', '.join(without)} were cached without the "
        f"target's top tokens, which distillation (--kl-weight {DEFAULT_KL_WEIGHT}, the default where they are at "
        f"hand) needs. `dflash features` caches them by default (--top-k {DEFAULT_TOP_K}) in a new --out folder."
    )


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

    accelerator = Accelerator(mixed_precision=autocast_precision(config.mixed_precision))
    device = accelerator.device
    output_dir = Path(config.output)
    output_dir.mkdir(parents=True, exist_ok=True)
    log_path = output_dir / "log.jsonl"

    def log(record):
        if accelerator.is_main_process:
            with open(log_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    folders = training_shards(config.data)  # refuse a bad --data before loading anything
    val_features = training_shards(config.val_features) if config.val_features else []

    # Target: frozen.
    if target is None:
        target = load_target(config.target, target_dtype(config.target_dtype, device))
    target.requires_grad_(False)
    target.eval()
    target.to(device)

    # Drafter: from the latest checkpoint, else the drafter to fine-tune, else freshly initialised (same seed on every
    # process). Float32 weights.
    checkpoint = latest_checkpoint(output_dir)
    torch.manual_seed(config.seed)
    if checkpoint is not None:
        drafter = DFlashDraftModel.from_pretrained(checkpoint, dtype=torch.float32)
    elif config.init_drafter is not None:
        if config.init_from_target:
            raise ValueError(
                "--init-drafter and --init-from-target both say where the weights start: keep one of them."
            )
        drafter = load_init_drafter(config, target)
    else:
        shape = {
            name: default if getattr(config, name) is None else getattr(config, name)
            for name, default in DRAFTER_DEFAULTS.items()
        }
        drafter = DFlashDraftModel.from_target(
            target,
            mask_token_id=config.mask_token_id,
            target_layer_ids=config.target_layer_ids,
            draft_vocab_size=config.draft_vocab_size,
            **shape,
        )
        if config.draft_vocab_size is not None:  # the drafter's own mask token never enters its draft vocabulary
            c = drafter.config
            drafter.set_draft_vocabulary(
                draft_vocabulary(config.data, c.draft_vocab_size, c.vocab_size, exclude=[c.mask_token_id])
            )
        if config.init_from_target:
            first = next(iter_training_examples(config.data))["input_ids"][: config.max_length]
            init_from_target_layers(drafter, target, first.unsqueeze(0))
    check_label_rule(config.labels)
    kl_weight, note = resolve_kl_weight(config.kl_weight, [folder for folder, _ in folders])
    if note:
        accelerator.print(note)
    config = replace(config, kl_weight=kl_weight)  # as trained with, in the log
    for folder, _ in folders:
        check_cached_features(folder, drafter.config.target_layer_ids, config.labels, config.kl_weight)
    for folder, _ in val_features:
        check_replay_features(folder, drafter.config.target_layer_ids)
    drafter.float().train()
    if drafter.config._attn_implementation in (None, "flash_attention_2"):
        drafter.config._attn_implementation = "sdpa"  # FlashAttention-2 cannot express the packed-block mask

    # Data: the first num_val_prompts examples are held out for validation unless val_data is given.
    shards = [shard for _, found in folders for shard in found]
    sizes = [size for folder, found in folders for size in shard_sizes(folder, found)]
    shard_offsets = [sum(sizes[:i]) for i in range(len(shards))]
    held_out = 0 if config.val_data else config.num_val_prompts
    num_examples = sum(sizes) - held_out
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
    log(
        {
            "event": "start",
            "step": step,
            "total_steps": total_steps,
            "num_examples": num_examples,
            "held_out": held_out,
            "config": asdict(config),
            "mixed_precision": accelerator.mixed_precision,
        }
    )

    batches = training_batches(
        shards,
        shard_offsets,
        num_examples,
        config.batch_size,
        config.max_length,
        config.seed,
        rank=accelerator.process_index,
        world_size=accelerator.num_processes,
        skip_below=held_out,
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
        if accelerator.is_main_process and val_features:
            replay = replay_acceptance(
                target, accelerator.unwrap_model(drafter), iter_training_examples(config.val_features)
            )
            record = {"val_replay_tau": replay["tau"], "val_replay_tau_all_anchors": replay["tau_all_anchors"]}
            summary.update(record)
            log({"step": step, **record, "val_replay_slot_accuracy": [round(a, 4) for a in replay["slot_accuracy"]]})
            progress.write(f"step {step}: replayed acceptance length {replay['tau']:.3f} on {config.val_features}")
        accelerator.wait_for_everyone()

    progress = tqdm(total=total_steps, initial=step, desc="train", disable=not accelerator.is_main_process)
    train_time, train_tokens = 0.0, 0
    loss_sum, steps_since_log = torch.zeros((), device=device), 0
    while step < total_steps:
        start = time.perf_counter()
        step_tokens = 0
        for micro_step in range(config.grad_accum):
            batch = {k: v.to(device) if v is not None else None for k, v in next(batches).items()}
            padding = batch["attention_mask"]
            step_tokens += batch["input_ids"].numel() if padding is None else int(padding.sum())  # sequence tokens
            # Gradients are all-reduced across processes on the last micro-batch only.
            is_last = micro_step == config.grad_accum - 1
            sync_context = contextlib.nullcontext() if is_last else accelerator.no_sync(drafter)
            with sync_context, accelerator.autocast():
                loss, metrics = dflash_loss(
                    drafter,
                    target,
                    batch["input_ids"],
                    batch["loss_mask"],
                    config.num_anchors,
                    attention_mask=batch["attention_mask"],
                    context_features=batch["context_features"],
                    gamma=config.gamma,
                    generator=anchor_generator,
                    target_ids=batch.get("target_ids"),
                    labels=config.labels,
                    target_top_ids=batch.get("target_top_ids"),
                    target_top_logprobs=batch.get("target_top_logprobs"),
                    kl_weight=config.kl_weight,
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
                "text_agreement": metrics["text_agreement"].item(),
                **({"kl": metrics["kl"].item()} if "kl" in metrics else {}),
                "slot_accuracy": [round(a, 4) for a in metrics["slot_accuracy"].tolist()],
                "lr": scheduler.get_last_lr()[0],
                "grad_norm": float(grad_norm),
                "tokens_per_second": train_tokens / train_time,
                "train_seconds": round(train_time, 2),  # this run's, without resumed runs' time
            }
            loss_sum.zero_()
            steps_since_log = 0
            log(record)
            summary.update(record)
            progress.set_postfix(
                loss=f"{record['loss']:.3f}",
                acc=f"{record['accuracy']:.3f}",
                tau=f"{record['acceptance_length']:.2f}",
                tok_s=f"{record['tokens_per_second']:.0f}",
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
