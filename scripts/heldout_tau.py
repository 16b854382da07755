"""Held-out tau of drafters, replayed over the target's own greedy answers (issue 13's evaluation, in seconds).

`replay_acceptance` (transformers_dflash.training) drafts a block at every response position of each cached answer
in one drafter forward, then replays greedy DFlash decoding (whole blocks, no copied drafts) over them: on the
target's own greedy answers it gives exactly the acceptance lengths `generate()` would, for all the prompts at once.
Build the held-out sets once (an exact engine, so that the answers are the target's greedy ones):

    dflash regenerate --target smollm2 --prompts mtbench --engine ctranslate2 --compute-type float32 --out HO-MT
    dflash regenerate --target smollm2 --prompts humaneval --engine ctranslate2 --compute-type float32 --out HO-HE
    dflash features --target smollm2 --data HO-MT --out HO-MT-F --max-length 1024   # and HO-HE -> HO-HE-F
    python scripts/heldout_tau.py --features HO-MT-F HO-HE-F --drafters DRAFTER [DRAFTER ...]

Prints one row per drafter: tau per features folder and pooled, with a 95 % bootstrap interval over the prompts, tau
over every anchor, the first slot's accuracy, and the difference to the first drafter's pooled tau with a 95 %
interval from resampling the prompts for both at once (a difference whose interval excludes 0 is resolved).
`--json` keeps every prompt's acceptance lengths, and `--compare A.json B.json ...` tabulates such files again
(the first is the reference) without running anything.
"""

import argparse
import json
import os
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pooled_tau(per_example: list[list[int]]) -> float:
    steps = [n for lengths in per_example for n in lengths]
    return sum(steps) / len(steps) if steps else float("nan")


def _bootstrap(items: list, statistic, resamples: int, seed: int) -> tuple[float, float]:
    """95 % interval of `statistic(items)` when the items (prompts) are resampled with replacement."""
    rng = random.Random(seed)
    values = sorted(statistic([items[rng.randrange(len(items))] for _ in items]) for _ in range(resamples))
    return values[int(0.025 * resamples)], values[int(0.975 * resamples) - 1]


def bootstrap_interval(per_example: list[list[int]], resamples: int = 1000, seed: int = 0) -> tuple[float, float]:
    """95 % interval of the pooled tau when the prompts are resampled with replacement."""
    totals = [(sum(lengths), len(lengths)) for lengths in per_example if lengths]
    return _bootstrap(totals, lambda sample: sum(t for t, _ in sample) / sum(n for _, n in sample), resamples, seed)


def paired_difference(per_example: list[list[int]], reference: list[list[int]], resamples: int = 1000, seed: int = 0):
    """Pooled tau minus the reference's on the same prompts, with a 95 % interval from resampling the prompts (the same
    resample for both drafters: far tighter than comparing their own intervals)."""
    pairs = [((sum(a), len(a)), (sum(b), len(b))) for a, b in zip(per_example, reference)]
    if len(per_example) != len(reference) or not pairs:
        raise ValueError("a paired difference needs the same prompts for both drafters")

    def difference(sample):
        return sum(a[0] for a, _ in sample) / sum(a[1] for a, _ in sample) - sum(b[0] for _, b in sample) / sum(
            b[1] for _, b in sample
        )

    return difference(pairs), _bootstrap(pairs, difference, resamples, seed)


def evaluate(target, drafter_path: str, features: list[Path]) -> dict:
    import torch

    from transformers_dflash import DFlashDraftModel
    from transformers_dflash.training import check_replay_features, iter_training_examples, replay_acceptance

    drafter = DFlashDraftModel.from_pretrained(drafter_path, dtype=torch.float32)
    result = {"drafter": drafter_path, "sets": {}}
    every = []
    for folder in features:
        check_replay_features(folder, drafter.config.target_layer_ids)
        replay = replay_acceptance(target, drafter, iter_training_examples(folder))
        every.extend(replay["acceptance_lengths"])
        result["sets"][folder.name] = {
            "tau": replay["tau"],
            "interval": bootstrap_interval(replay["acceptance_lengths"]),
            "tau_all_anchors": replay["tau_all_anchors"],
            "anchors": replay["anchors"],
            "slot_accuracy": replay["slot_accuracy"],
            "prompts": len(replay["acceptance_lengths"]),
        }
    result["tau"], result["interval"] = pooled_tau(every), bootstrap_interval(every)
    result["acceptance_lengths"] = every
    return result


def table(results: list[dict]) -> str:
    names = list(results[0]["sets"])
    header = "| drafter | " + " | ".join(f"tau {n}" for n in names) + " | tau all (95 % interval) | "
    header += "tau all anchors | slot-1 accuracy | difference to the first (95 % paired interval) |"
    lines = [header, "|---|" + "---:|" * (len(names) + 4)]
    for r in results:
        sets = [r["sets"][n] for n in names]
        # pooled over every anchor of every set (older --json files without anchor counts: the sets' mean)
        weights = [s.get("anchors", 1) for s in sets]
        anchors = sum(s["tau_all_anchors"] * w for s, w in zip(sets, weights)) / sum(weights)
        slot1 = sum(s["slot_accuracy"][0] * w for s, w in zip(sets, weights)) / sum(weights)  # slot 1: every anchor
        low, high = r["interval"]
        lines.append(
            f"| {r['drafter']} | "
            + " | ".join(f"{s['tau']:.3f}" for s in sets)
            + f" | {r['tau']:.3f} ({low:.3f}-{high:.3f}) | {anchors:.3f} | {slot1:.3f} | "
            + (paired_cell(r, results[0]) if r is not results[0] else "")
            + " |"
        )
    return "\n".join(lines) + "\n"


def paired_cell(result: dict, reference: dict) -> str:
    if "acceptance_lengths" not in result or "acceptance_lengths" not in reference:
        return "?"
    difference, (low, high) = paired_difference(result["acceptance_lengths"], reference["acceptance_lengths"])
    return f"{difference:+.3f} ({low:+.3f} to {high:+.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--features", type=Path, nargs="+", default=[], help="held-out features folders")
    parser.add_argument("--drafters", nargs="+", default=[], help="drafter folders (or checkpoints)")
    parser.add_argument("--compare", type=Path, nargs="+", help="tabulate --json files of earlier runs instead")
    parser.add_argument("--target", default="smollm2", help='the target: a path or hub id, or "smollm2"')
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.compare:
        print(table([result for path in args.compare for result in json.loads(path.read_text())]))
        return
    if not args.features or not args.drafters:
        parser.error("name --features and --drafters (or --compare earlier --json files)")

    import torch

    from transformers_dflash.training import load_target

    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target, torch.float32).eval()
    results = [evaluate(target, path, args.features) for path in args.drafters]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()
