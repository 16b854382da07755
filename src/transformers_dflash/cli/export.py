"""`dflash export`: write a drafter in the Hub, released DFlash (SGLang/vLLM) or vLLM speculators layout, with a model
card. Also the options and the writing that `dflash convert` shares. The interop code loads when the options are
added (the layouts are its choices), not for `dflash --help`."""

from __future__ import annotations

import argparse
import json


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `dflash export` and `dflash convert` that say what to write and where."""
    parser.add_argument("--out", required=True, help="the folder to write (must be empty unless --overwrite)")
    parser.add_argument(
        "--target",
        default=None,
        help="the target model's Hub id or path: the card's base_model and the speculators verifier (default: the one "
        "recorded in the source folder, if any)",
    )
    parser.add_argument(
        "--repo-id",
        default=None,
        help="the Hub repo the folder will be uploaded to, for the card's usage snippets (default: "
        "none, the snippets name a placeholder)",
    )
    parser.add_argument(
        "--card",
        default=None,
        help="a JSON file of model-card metadata (keys: transformers_dflash.model_card.CardMetadata; default: none, "
        "the card holds what the source folder records)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights' dtype in the output ('auto': the source's)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace the checkpoint files of a non-empty --out")


def add_export_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of `dflash export`."""
    from ..interop import LAYOUTS

    parser.add_argument("drafter", help="a drafter folder in any layout (e.g. the output of `dflash train`)")
    parser.add_argument(
        "--layout",
        required=True,
        choices=LAYOUTS,
        help="hub: transformers + Hub; released: the "
        "released DFlash layout (SGLang, vLLM); speculators: the vLLM speculators layout",
    )
    add_output_arguments(parser)
    parser.epilog = (
        "examples:\n"
        "  dflash export --layout hub --out my-drafter-hub runs/drafter\n"
        "  dflash export --layout released --target Qwen/Qwen3-8B --out my-drafter-sglang runs/drafter\n"
        "  dflash export --layout speculators --target Qwen/Qwen3-8B --out my-drafter-vllm runs/drafter\n"
        "  hf upload YOUR-NAME/my-drafter my-drafter-hub   # upload (older hubs: huggingface-cli upload)"
    )
    return parser


def _write(source: str, layout: str, args: argparse.Namespace, verb: str) -> int:
    from ..interop import CardMetadata, card_info, convert_drafter, detect_layout, export_drafter
    from ..interop.convert import local_folder

    folder = local_folder(source)
    source_layout = detect_layout(folder)
    drafter = convert_drafter(folder, dtype=args.dtype)
    metadata = CardMetadata.coerce(card_info(folder))
    if args.card:
        with open(args.card, encoding="utf-8") as f:
            metadata = metadata.merged(json.load(f))
    metadata = metadata.merged({"target": args.target, "model_id": args.repo_id})
    out = export_drafter(
        drafter, args.out, layout, target_name_or_path=metadata.target, card_metadata=metadata, overwrite=args.overwrite
    )
    files = ", ".join(sorted(p.name for p in out.iterdir() if p.is_file()))
    print(f"{verb} {source} ({source_layout} layout) -> {out} ({layout} layout): {files}")
    return 0


def write_layout(source: str, layout: str, args: argparse.Namespace, verb: str, command: str) -> int:
    """Read the drafter at `source` (any layout) and write it to `args.out` in `layout`; bad input exits with the
    reason, prefixed by `dflash <command>`."""
    try:
        return _write(source, layout, args, verb)
    except (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError) as error:
        raise SystemExit(f"dflash {command}: {error}") from error


def run_export(args: argparse.Namespace) -> int:
    """`dflash export`."""
    return write_layout(args.drafter, args.layout, args, "Exported", "export")
