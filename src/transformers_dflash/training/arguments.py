"""The command lines of `dflash train` and `dflash features`."""

import argparse
from dataclasses import fields

import torch

from ..target_model import text_config
from .features import DEFAULT_TOP_K, cache_context_features, read_features_info
from .loop import DEFAULT_KL_WEIGHT, DRAFTER_DEFAULTS, TrainingConfig, load_target, target_dtype, train


def add_train_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of `dflash train`; their names are the fields of `TrainingConfig`."""
    d = TrainingConfig()
    parser.add_argument("--target", default=d.target, help='target model path or hub id, or "smollm2"')
    parser.add_argument(
        "--data",
        required=True,
        nargs="+",
        help="folder of shard-XXXXX.parquet or .pt files (format: see transformers_dflash.training); several "
        "folders are trained on as one dataset, e.g. regenerated answers beside off-the-shelf replies",
    )
    parser.add_argument("--output", required=True, help="checkpoints, final drafter, log.jsonl; resumes from here")
    parser.add_argument("--val-data", default=None, help="shards of validation prompts (default: held-out training)")
    parser.add_argument(
        "--val-features",
        default=None,
        nargs="+",
        help="features folder(s) of the target's own greedy answers to held-out prompts (`dflash regenerate "
        "--prompts mtbench`, then `dflash features --dtype float32`): each validation also replays greedy decoding "
        "with whole blocks over every one of them (`val_replay_tau` in log.jsonl), without decoding",
    )
    shape = DRAFTER_DEFAULTS
    parser.add_argument(
        "--init-drafter",
        default=None,
        help="fine-tune this trained drafter (its folder) instead of starting from random weights; it keeps its "
        "shape and draft vocabulary, so the shape options below can be left out (default: train from scratch)",
    )
    parser.add_argument(
        "--init-from-target",
        action="store_true",
        help="start a new drafter's layers from the target's last layers (and its final norm) instead of random "
        "weights, with fc reading the deepest target feature; Llama / Qwen-style targets (docs/training.md)",
    )
    parser.add_argument("--num-layers", type=int, default=None, help=f"drafter layers (default: {shape['num_layers']})")
    parser.add_argument(
        "--block-size",
        type=int,
        default=None,
        help=f"tokens per draft block, anchor included (default: {shape['block_size']})",
    )
    parser.add_argument("--mask-token-id", type=int, default=None, help="default: last row of the target's embeddings")
    parser.add_argument("--target-layer-ids", type=int, nargs="+", default=None, help="default: DFlash's spread")
    parser.add_argument(
        "--num-target-features",
        type=int,
        default=None,
        help=f"target layers feeding the drafter (default: {shape['num_target_features']})",
    )
    parser.add_argument(
        "--draft-vocab-size",
        type=int,
        default=None,
        help="draft only from the N most frequent response tokens of the data (default: all tokens)",
    )
    parser.add_argument("--num-anchors", type=int, default=d.num_anchors, help="blocks per sequence")
    parser.add_argument("--gamma", type=float, default=None, help="loss decay (default: 7 for block 16, 5 for 10)")
    parser.add_argument(
        "--labels",
        choices=["auto", "target", "text"],
        default=d.labels,
        help="what a draft slot learns: 'target' = the target's own greedy choice, masked where the text left the "
        "target's path (what verification accepts); 'text' = the data's tokens; 'auto' = 'target' when the target's "
        "choices are known (features from `dflash features`, or online training)",
    )
    parser.add_argument(
        "--kl-weight",
        type=float,
        default=d.kl_weight,
        help="distillation: share of KL(target || drafter) over the target's top tokens in the loss, the rest being "
        f"cross-entropy on the hard labels (default: {DEFAULT_KL_WEIGHT} where the target's top tokens are at hand, "
        "as `dflash features` caches them by default or online training computes them, else 0)",
    )
    parser.add_argument("--max-length", type=int, default=d.max_length, help="truncate sequences to this many tokens")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per process and micro-batch")
    parser.add_argument("--grad-accum", type=int, default=d.grad_accum, help="micro-batches per optimizer step")
    parser.add_argument("--epochs", type=float, default=d.epochs, help="passes over the data")
    parser.add_argument("--max-steps", type=int, default=None, help="optimizer steps (overrides --epochs)")
    parser.add_argument("--lr", type=float, default=d.lr, help="peak AdamW learning rate (cosine schedule)")
    parser.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay")
    parser.add_argument(
        "--warmup-ratio", type=float, default=d.warmup_ratio, help="share of the steps spent warming up"
    )
    parser.add_argument("--grad-clip", type=float, default=d.grad_clip, help="gradient norm clipping")
    parser.add_argument(
        "--mixed-precision",
        choices=["auto", "no", "bf16", "fp16"],
        default=d.mixed_precision,
        help="autocast of the drafter's forward and loss, its weights staying float32; auto: bf16 on a GPU that has "
        "it and on a CPU with AMX or AVX512-BF16, else no",
    )
    parser.add_argument(
        "--target-dtype",
        choices=["auto", "bfloat16", "float16", "float32"],
        default=d.target_dtype,
        help="dtype the frozen target is loaded in",
    )
    parser.add_argument("--save-every", type=int, default=d.save_every, help="checkpoint every N optimizer steps")
    parser.add_argument(
        "--keep-checkpoints", type=int, default=d.keep_checkpoints, help="checkpoints kept on disk (oldest removed)"
    )
    parser.add_argument("--eval-every", type=int, default=d.eval_every, help="validate every N optimizer steps")
    parser.add_argument(
        "--num-val-prompts", type=int, default=d.num_val_prompts, help="prompts decoded by each validation"
    )
    parser.add_argument(
        "--val-max-new-tokens", type=int, default=d.val_max_new_tokens, help="new tokens per validation prompt"
    )
    parser.add_argument("--log-every", type=int, default=d.log_every, help="log every N optimizer steps")
    parser.add_argument("--seed", type=int, default=d.seed, help="random seed (data order, anchors, init)")
    return parser


def run_train(args: argparse.Namespace) -> dict:
    """`dflash train`: build a `TrainingConfig` from parsed `add_train_arguments` options and train."""
    options = {f.name: getattr(args, f.name) for f in fields(TrainingConfig) if hasattr(args, f.name)}
    if len(options["data"]) == 1:
        options["data"] = options["data"][0]
    if options.get("val_features") and len(options["val_features"]) == 1:
        options["val_features"] = options["val_features"][0]
    return train(TrainingConfig(**options))


def add_features_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of `dflash features`."""
    parser.add_argument("--target", default="smollm2", help='target model path or hub id, or "smollm2"')
    parser.add_argument("--data", required=True, help="directory of regenerated shard-XXXXX.parquet or .pt files")
    parser.add_argument("--out", required=True, help="where the shards with features go (resumes there)")
    parser.add_argument(
        "--target-layer-ids",
        type=int,
        nargs="+",
        default=None,
        help="default: DFlash's spread of --num-target-features layers, as `dflash train` picks them",
    )
    parser.add_argument("--num-target-features", type=int, default=5, help="target layers feeding the drafter")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per target forward")
    parser.add_argument("--max-length", type=int, default=2048, help="truncate sequences to this many tokens")
    parser.add_argument(
        "--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16", help="storage dtype of the features"
    )
    parser.add_argument(
        "--target-dtype",
        choices=["auto", "bfloat16", "float32"],
        default="auto",
        help="dtype the target runs in (auto: bfloat16 on GPU, float32 on CPU); float32 on a GPU keeps the target's "
        "choices (`target_ids`) those of the float32 target, e.g. for held-out sets replayed exactly",
    )
    parser.add_argument(
        "--top-k",
        type=int,
        default=None,
        help="also keep the target's K most likely next tokens and their log-probabilities at every position, the "
        f"soft labels of `dflash train --kl-weight` (default: {DEFAULT_TOP_K}, or the K of the features already in "
        "--out when resuming; 0 = none)",
    )
    parser.add_argument(
        "--follow",
        action="store_true",
        help="keep going while `dflash regenerate` is still writing --data: compute each new shard's features as it "
        "lands, and stop when the regeneration is complete",
    )
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (e.g. for a log file)")
    return parser


def run_features(args: argparse.Namespace) -> int:
    """`dflash features`: cache the target's context features next to the tokens, for offline `dflash train`."""
    from ..configuration_dflash import default_target_layer_ids

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target(args.target, target_dtype(args.target_dtype, device)).to(device).eval()
    layer_ids = args.target_layer_ids
    if layer_ids is None:
        lm_config = text_config(target.config)
        layer_ids = default_target_layer_ids(lm_config.num_hidden_layers, args.num_target_features)
    if args.top_k is not None and args.top_k < 0:
        raise ValueError(f"--top-k {args.top_k}: use 0 (no soft labels) or a positive number of tokens, e.g. 16.")
    out = cache_context_features(
        target,
        args.data,
        args.out,
        layer_ids,
        args.batch_size,
        args.max_length,
        getattr(torch, args.dtype),
        top_k=args.top_k,
        follow=args.follow,
        progress=not args.no_progress,
    )
    top_k = read_features_info(out).get("target_top_k", 0)
    top = f" and the target's top {top_k} tokens per position (distillation)" if top_k else ""
    print(f"features of layers {layer_ids}{top} in {out}; train on them with `dflash train --data {out} ...`")
    return 0
