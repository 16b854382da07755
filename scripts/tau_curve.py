"""Held-out tau against the number of training samples and the training time (issue 13, item 4).

For each data size (a number of feature shards, the first K of the `--features` folders), train a drafter with one fixed recipe,
keep a checkpoint at every step of `--eval-at`, and measure each checkpoint's acceptance length on held-out
MT-Bench and HumanEval prompts with `dflash bench`. Every stage resumes: a finished run or evaluation is kept, an
interrupted training run continues from its last checkpoint. Two instances with different `--shards` can run side by
side (one thread each); `--report` then writes the table of whatever is finished.

    python scripts/tau_curve.py --features FEATURES --out CURVE --shards 1 2 4 --steps 400 --eval-at 100 200 400
    python scripts/tau_curve.py --features FEATURES --out CURVE --report CURVE/curve.md

With `--val-features HELDOUT-F ...` (features of the target's greedy answers to held-out prompts, see
scripts/heldout_tau.py) each checkpoint is measured by replay over every held-out prompt instead (seconds, and
exactly the acceptance lengths of greedy decoding with whole blocks); give it to `--report` as well.

Training time is the CPU time (user + system) of the training processes, summed over resumes, so that runs sharing
a machine compare fairly; wall time is recorded beside it.
"""

import argparse
import json
import math
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The recipe of scripts/train_smollm2.sh (the shipped drafter), minus the step count.
RECIPE = [
    "--num-layers", "2", "--block-size", "8", "--mask-token-id", "16", "--draft-vocab-size", "8192",
    "--num-anchors", "64", "--max-length", "1024", "--batch-size", "8", "--lr", "8e-4", "--warmup-ratio", "0.03",
    "--eval-every", "1000000", "--num-val-prompts", "4", "--log-every", "10",
]  # fmt: skip
BENCH = [
    "--dataset", "mtbench", "--dataset", "humaneval", "--num-prompts", "3", "--max-new-tokens", "128",
    "--temperatures", "0", "--methods", "dflash", "--no-draft-check",
]  # fmt: skip


def dflash(*args: str, threads: int) -> float:
    """Run `dflash ARGS` from this checkout; return its CPU seconds."""
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(threads))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-m", "transformers_dflash.cli", *args], env=env, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def subset(features: list[Path], out: Path, num_shards: int) -> list[Path]:
    """Data folders holding links to the first `num_shards` feature shards of the `features` folders (taken in the
    order given) and their features.json: one folder per features folder that contributes a shard."""
    shards = [(i, shard) for i, folder in enumerate(features) for shard in sorted(folder.glob("shard-*.pt"))]
    if len(shards) < num_shards:
        raise SystemExit(
            f"{' '.join(map(str, features))} hold {len(shards)} feature shards; --shards asks for {num_shards}."
        )
    folders = []
    for i, source in shards[:num_shards]:
        folder = out / f"data-{num_shards}" / str(i) if len(features) > 1 else out / f"data-{num_shards}"
        if folder not in folders:
            folder.mkdir(parents=True, exist_ok=True)
            folders.append(folder)
        for target in (source, features[i] / "features.json"):
            link = folder / target.name
            if not link.exists():
                link.symlink_to(target.resolve())
    return folders


def train_and_evaluate(args, num_shards: int) -> None:
    data = [str(folder) for folder in subset(args.features, args.out, num_shards)]
    run = args.out / f"run-{num_shards}"
    record_path = args.out / f"run-{num_shards}.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {"cpu_s": 0.0, "wall_s": 0.0}
    if not (run / "model.safetensors").exists():
        save_every = math.gcd(*args.eval_at)
        start = time.time()
        cpu = dflash(
            "train", "--target", "smollm2", "--data", *data, "--output", str(run), *RECIPE,
            "--max-steps", str(args.steps), "--save-every", str(save_every),
            "--keep-checkpoints", str(args.steps // save_every), "--labels", args.labels, *args.train_args,
            threads=args.threads,
        )  # fmt: skip
        record["cpu_s"] += cpu
        record["wall_s"] += time.time() - start
        record_path.write_text(json.dumps(record, indent=1))
    for step in args.eval_at:
        name = f"run-{num_shards}-step-{step}"
        checkpoint = run / f"checkpoint-{step:08d}"
        if args.val_features:  # replayed over the target's greedy answers to every held-out prompt
            replay_path = args.out / "eval" / f"{name}.replay.json"
            if not replay_path.exists():
                env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
                subprocess.run(
                    [sys.executable, str(REPO / "scripts" / "heldout_tau.py"), "--drafters", str(checkpoint),
                     "--features", *map(str, args.val_features), "--threads", str(args.threads),
                     "--json", str(replay_path)],
                    env=env, check=True,
                )  # fmt: skip
            continue
        if (args.out / "eval" / f"{name}.json").exists():
            continue
        dflash(
            "bench", "--drafter", str(checkpoint), *BENCH, "--threads", str(args.threads),
            "--output-dir", str(args.out / "eval"), "--name", name,
            threads=args.threads,
        )  # fmt: skip


def replay_report(args) -> str:
    """The table of runs evaluated with --val-features: tau per held-out set, pooled with its 95 % interval."""
    lines, names = [], None
    for record_path in sorted(args.out.glob("run-*.json"), key=lambda p: int(p.stem.split("-")[1])):
        num_shards = int(record_path.stem.split("-")[1])
        log = [json.loads(line) for line in (args.out / f"run-{num_shards}" / "log.jsonl").read_text().splitlines()]
        start = next(r for r in log if r.get("event") == "start")
        cpu_s, examples = json.loads(record_path.read_text())["cpu_s"], start.get("num_examples")
        paths = sorted(
            args.out.glob(f"eval/run-{num_shards}-step-*.replay.json"),
            key=lambda p: int(p.stem.split("-")[3].split(".")[0]),
        )
        for path in paths:
            step = int(path.stem.split("-")[3].split(".")[0])
            result = json.loads(path.read_text())[0]
            names = names or list(result["sets"])
            epochs = f"{step * start['config']['batch_size'] / examples:.1f}" if examples else "?"
            low, high = result["interval"]
            lines.append(
                f"| {num_shards} | {examples or '?'} | {step} | {epochs} | {cpu_s * step / start['total_steps'] / 60:.0f} | "
                + " | ".join(f"{result['sets'][n]['tau']:.3f}" for n in names)
                + f" | {result['tau']:.3f} ({low:.3f}-{high:.3f}) |"
            )
    names = names or []
    header = "| shards | training sequences | steps | epochs | training CPU-min | " + " | ".join(
        f"tau {n}" for n in names
    )
    header += " | tau all (95 % interval) |"
    return "\n".join([header, "|" + "---:|" * (6 + len(names)), *lines]) + "\n"


def report(args) -> str:
    if getattr(args, "val_features", None):
        return replay_report(args)
    rows = []
    for record_path in sorted(args.out.glob("run-*.json"), key=lambda p: int(p.stem.split("-")[1])):
        num_shards = int(record_path.stem.split("-")[1])
        run = args.out / f"run-{num_shards}"
        log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
        start = next(r for r in log if r.get("event") == "start")
        total_steps = start["total_steps"]
        record = json.loads(record_path.read_text())
        examples = start.get("num_examples")
        for eval_path in sorted((args.out / "eval").glob(f"run-{num_shards}-step-*.json")):
            step = int(eval_path.stem.rsplit("-", 1)[1])
            evaluation = json.loads(eval_path.read_text())
            summary = {s["dataset"]: s for s in evaluation["summary"] if s["method"] == "dflash"}
            # each prompt's own tau: how far apart the prompts are says what difference the table can resolve
            per_prompt = [
                sum(sample["acceptance"]) / len(sample["acceptance"])
                for sample in evaluation.get("samples", [])
                if sample["method"] == "dflash" and sample.get("acceptance")
            ]
            rows.append(
                {
                    "shards": num_shards,
                    "examples": examples,
                    "step": step,
                    "epochs": step * start["config"]["batch_size"] / examples if examples else None,
                    "cpu_min": record["cpu_s"] * step / total_steps / 60,
                    "tau_mtbench": summary["mtbench"]["tau"],
                    "tau_humaneval": summary["humaneval"]["tau"],
                    "tau": summary["all"]["tau"],
                    "mismatches": summary["all"]["mismatches"],
                    "per_prompt": (min(per_prompt), max(per_prompt)) if per_prompt else None,
                }
            )
    lines = [
        "| shards | training sequences | steps | epochs | training CPU-min | tau MT-Bench | tau HumanEval | tau all "
        "| tau per prompt |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["shards"], r["step"])):
        epochs = f"{r['epochs']:.1f}" if r["epochs"] else "?"
        spread = f"{r['per_prompt'][0]:.2f}-{r['per_prompt'][1]:.2f}" if r["per_prompt"] else "?"
        lines.append(
            f"| {r['shards']} | {r['examples'] or '?'} | {r['step']} | {epochs} | {r['cpu_min']:.0f} | "
            f"{r['tau_mtbench']:.2f} | {r['tau_humaneval']:.2f} | {r['tau']:.2f} | {spread} |"
        )
    if any(r["mismatches"] for r in rows):
        lines.append("\nSome outputs differed from plain generate(): see the eval reports.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--features", type=Path, nargs="+", required=True,
        help="`dflash features` folders; their shards in the order given (e.g. regenerated answers, then more)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, required=True, help="runs, evaluations and the report go here")
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4], help="data sizes, in feature shards")
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps per run (batch 8)")
    parser.add_argument("--eval-at", type=int, nargs="+", default=[100, 200, 400], help="steps to evaluate")
    parser.add_argument("--labels", default="auto", help="dflash train --labels")
    parser.add_argument(
        "--val-features", type=Path, nargs="+",
        help="evaluate by replay over these held-out features folders (scripts/heldout_tau.py: every prompt, "
        "seconds) instead of decoding 6 prompts with `dflash bench`",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--report", type=Path, help="write the table of finished runs here, and stop")
    parser.add_argument("train_args", nargs="*", help="more `dflash train` options, after --")
    args = parser.parse_args()
    if args.report:
        table = report(args)
        args.report.write_text(table)
        print(table)
        return
    if max(args.eval_at) != args.steps:
        parser.error("--eval-at must end at --steps (the last checkpoint is the trained drafter)")
    # `kill` (SIGTERM) as an exception, so that subprocess.run kills the training or replay it waits for: left
    # running, a replay went on competing with the next run for the 2 cores.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    for num_shards in args.shards:
        train_and_evaluate(args, num_shards)


if __name__ == "__main__":
    main()
