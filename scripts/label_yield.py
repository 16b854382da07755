"""How much training signal a dataset keeps under the target-label rule (issue 13, item 2): for cached features
(`dflash features`), the share of response tokens equal to the target's greedy choice, and the labelled slots per
draft block when a slot counts only while the text before it follows the target's greedy path.

Usage: python scripts/label_yield.py FEATURES_DIR [FEATURES_DIR ...] [--block-size 8 16]
"""

import argparse
import json
from pathlib import Path

import torch


def label_yield(features_dir: Path, block_size: int) -> dict:
    agree = tokens = blocks = labelled = 0
    for shard in sorted(features_dir.glob("shard-*.pt")):
        for record in torch.load(shard, weights_only=True):
            on_path = (record["target_ids"] == record["input_ids"]) & record["loss_mask"]
            tokens += int(record["loss_mask"].sum())
            agree += int(on_path.sum())
            # run[t]: consecutive on-path response tokens starting at t (a reverse cumulative count).
            run = torch.zeros(len(on_path) + 1, dtype=torch.long)
            for t in range(len(on_path) - 1, -1, -1):  # one pass per sequence; a script, not a hot loop
                run[t] = run[t + 1] + 1 if on_path[t] else 0
            anchors = record["loss_mask"][: len(on_path) - block_size + 1].nonzero().flatten()
            if len(anchors):
                # slot 1 always counts; slot k > 1 needs the k - 1 text tokens after the anchor on the path
                blocks += len(anchors)
                labelled += int((1 + run[anchors + 1]).clamp(max=block_size - 1).sum())
    return {
        "features": str(features_dir),
        "response_tokens": tokens,
        "target_agreement": agree / max(tokens, 1),
        "block_size": block_size,
        "blocks": blocks,
        "labelled_slots_per_block": labelled / max(blocks, 1),
        "share_of_text_labels": labelled / max(blocks * (block_size - 1), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("features", nargs="+", type=Path)
    parser.add_argument("--block-size", type=int, nargs="+", default=[8, 16])
    args = parser.parse_args()
    for directory in args.features:
        for block_size in args.block_size:
            print(json.dumps(label_yield(directory, block_size)))


if __name__ == "__main__":
    main()
