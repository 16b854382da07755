"""The report's outputs: the environment it ran in, Markdown, a PNG plot, and the files `write_report` writes."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .metrics import median_and_range


def _git_commit() -> dict:
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        return {"commit": commit, "dirty": bool(dirty)}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def command_line(argv: list[str] | None = None) -> str:
    """The command that ran, as one can paste it again: `python -m transformers_dflash.cli ...` and the console script
    both read `dflash ...` (argv[0] is then the module's file path, or the script's in a virtual environment)."""
    program, *args = sys.argv if argv is None else argv
    if Path(program).name == "dflash" or Path(program).parts[-3:] == ("transformers_dflash", "cli", "__main__.py"):
        program = "dflash"
    return shlex.join([program, *args])


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device=None) -> dict:
    """Versions, device, threads and git commit, for the JSON report."""
    import torch
    import transformers

    from .. import __version__

    env = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "transformers_dflash": __version__,
        "device": str(device) if device is not None else "cpu",
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "git": _git_commit(),
        "command": command_line(),
    }
    if device is not None and str(device).startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    try:
        import flash_attn  # noqa: F401

        env["flash_attn"] = getattr(flash_attn, "__version__", "installed")
    except ImportError:
        pass
    return env


def fmt(value, spec: str) -> str:
    """`value` formatted with `spec`; "n/a" for None, NaN and infinities."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return format(value, spec)


def _times(value) -> str:
    """A ratio as `1.08x` ("n/a" when there is none)."""
    text = fmt(value, ".2f")
    return text if text == "n/a" else text + "x"


def _median_range_cell(ratios) -> str:
    """A table cell (with its closing bar) of per-repeat ratios: `1.84x (1.75-2.05)`."""
    median, low, high = median_and_range(ratios or [])
    return f" {fmt(median, '.2f')}x ({fmt(low, '.2f')}-{fmt(high, '.2f')}) |"


def table_section(title: str, header: str, columns: str, alignment: str, rows: list[str], footnote: str) -> str:
    """A Markdown section: `## title`, an optional header, one table (`columns` and `alignment` are its first two
    lines, `rows` the rest) and a footnote that says how to read it."""
    lines = [f"## {title}", ""] + ([header, ""] if header else []) + [columns, alignment, *rows]
    return "\n".join(lines + ["", footnote, ""])


def chat_template_kwargs_text(kwargs) -> str:
    """How the report names the chat template's extra variables: their JSON, or that there were none."""
    return f"`{json.dumps(kwargs)}`" if kwargs else "none (the template's defaults)"


def format_markdown(report: Mapping[str, Any]) -> str:
    """The report as Markdown: settings, one table per temperature, acceptance histograms, checks, notes."""
    settings, env = report["settings"], report["environment"]
    labels = {name: info["label"] for name, info in report["methods"].items()}
    git = env.get("git") or {}
    lines = [
        "## DFlash benchmark",
        "",
        f"- command: `{env.get('command', '')}`",
        f"- target: {settings.get('target', 'n/a')}; drafter: {settings.get('drafter') or 'n/a'}",
        f"- datasets: {', '.join(f'{k} ({v} prompts)' for k, v in settings['datasets'].items())}; "
        f"max new tokens {settings['max_new_tokens']}; block size {settings.get('block_size')}; "
        f"repeats {settings['repeats']}; warm-up {settings['warmup']}; seed {settings['seed']}",
        f"- chat template kwargs: {chat_template_kwargs_text(settings.get('chat_template_kwargs'))}",
        f"- {env.get('device')} ({env.get('gpu') or env.get('cpu')}), {env.get('torch_threads')} torch thread(s), "
        f"dtype {settings.get('dtype', 'n/a')}, attention {settings.get('attn_implementation', 'n/a')}",
        f"- torch {env.get('torch')}, transformers {env.get('transformers')}, transformers-dflash "
        f"{env.get('transformers_dflash')}, commit {str(git.get('commit'))[:10]}{' (dirty)' if git.get('dirty') else ''}",
        "",
    ]
    for note in report.get("notes", []):
        lines += [f"> **Note.** {note}", ""]
    rows = report["summary"]
    per_repeat = settings.get("repeats", 1) > 1
    costs = settings.get("fixed_step_costs")
    modelled = bool(costs)
    if modelled:
        verify = ", ".join(f"{1000 * s:.1f}" for s in costs["verify_seconds"])
        drafts = ", ".join(f"{1000 * s:.1f}" for s in costs["draft_seconds"].values())
        lines += [
            f"- fixed step costs (ms): verify 1..{len(costs['verify_seconds'])} tokens {verify}; draft {drafts}. "
            '"auto" chose every width from these, not from its own timing: the modelled figures depend on the '
            "drafts alone.",
            "",
        ]
    for temperature in sorted({r["temperature"] for r in rows}):
        kind = "greedy" if temperature == 0 else "sampling"
        lines += [
            f"### Temperature {temperature:g} ({kind})",
            "",
            "| dataset | method | tokens/s | TPOT (ms) | speedup |"
            + (" speedup per repeat: median (min-max) |" if per_repeat else "")
            + (" modelled speedup |" if modelled else "")
            + " tau | r = tau/speedup | new tokens | mismatches |",
            "|---|---|---:|---:|---:|"
            + ("---:|" if per_repeat else "")
            + ("---:|" if modelled else "")
            + "---:|---:|---:|---:|",
        ]
        for r in rows:
            if r["temperature"] != temperature:
                continue
            mismatch = "-" if temperature > 0 else str(r["mismatches"])
            spread = _median_range_cell(r.get("speedup_per_repeat")) if per_repeat else ""
            if modelled:
                spread += f" {_times(r.get('modelled_speedup'))} |"
            lines.append(
                f"| {r['dataset']} | {labels.get(r['method'], r['method'])} | {fmt(r['tokens_per_s'], '.1f')} | "
                f"{fmt(r['tpot_ms'], '.1f')} | {fmt(r['speedup'], '.2f')}x |{spread} {fmt(r['tau'], '.2f')} | "
                f"{fmt(r['r'], '.2f')} | {r['new_tokens']} | {mismatch} |"
            )
        lines.append("")
    for comparison in report.get("comparisons") or []:
        ours, other = labels.get(comparison["method"]), labels.get(comparison["other"])
        lines += [
            f"### {ours} vs {other}" + (" (same drafter weights)" if comparison["other"] == "builtin_dflash" else ""),
            "",
            "| temperature | dataset | tokens/s ratio |"
            + (" per repeat: median (min-max) |" if per_repeat else "")
            + (" modelled ratio |" if modelled else "")
            + f" tau {comparison['method']} | tau {comparison['other']} |",
            "|---:|---|---:|" + ("---:|" if per_repeat else "") + ("---:|" if modelled else "") + "---:|---:|",
        ]
        for c in comparison["rows"]:
            spread = _median_range_cell(c.get("ratio_per_repeat")) if per_repeat else ""
            if modelled:
                spread += f" {_times(c.get('modelled_ratio'))} |"
            lines.append(
                f"| {c['temperature']:g} | {c['dataset']} | {fmt(c['ratio'], '.2f')}x |{spread} "
                f"{fmt(c['tau'], '.2f')} | {fmt(c['other_tau'], '.2f')} |"
            )
        lines.append("")
    hist_rows = [
        r
        for r in rows
        if r["method"] != "baseline"
        and r["acceptance_histogram"]
        and (r["dataset"] == "all" or len(settings["datasets"]) == 1)
    ]
    if hist_rows:
        width = max(max(r["acceptance_histogram"]) for r in hist_rows)
        lines += [
            "### Acceptance-length histograms (verification steps committing n tokens; prefill excluded)",
            "",
            "| T | method | " + " | ".join(str(n) for n in range(1, width + 1)) + " |",
            "|---:|---|" + "---:|" * width,
        ]
        for r in hist_rows:
            h = r["acceptance_histogram"]
            lines.append(
                f"| {r['temperature']:g} | {labels.get(r['method'], r['method'])} | "
                + " | ".join(str(h.get(n, 0)) for n in range(1, width + 1))
                + " |"
            )
        lines.append("")
    check = report.get("draft_check")
    if check:
        verdict = "identical" if check["all_equal"] else "DIFFERENT"
        lines += [
            "### Draft-for-draft check: our drafter vs the converted built-in drafter (greedy, first prompt)",
            "",
            f"{verdict}: {check['steps_equal']}/{check['steps_compared']} steps proposed the same tokens "
            f"(ours {check['ours_steps']} steps, built-in {check['builtin_steps']}); outputs equal: "
            f"{check['outputs_equal']}.",
            "",
        ]
        if check["first_difference"]:
            d = check["first_difference"]
            lines += [f"First difference at step {d['step']}: ours {d['ours']} vs built-in {d['builtin']}.", ""]
    profiles = report.get("step_profile") or {}
    if profiles:
        lines += [
            "### Where a step's time goes (ms per verification step; greedy, first prompt, separate run)",
            "",
            "| method | draft | verify (target forward) | cache crop | accept/commit | other (Python) | step | prefill "
            "| verified width | tau |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, p in profiles.items():
            lines.append(
                f"| {labels.get(name, name)} | {p['draft_ms']:.1f} | {p['verify_ms']:.1f} | {p['cache_crop_ms']:.2f} | "
                f"{p['accept_commit_ms']:.2f} | {p['other_ms']:.1f} | {p['step_ms']:.1f} | {p['prefill_ms']:.1f} | "
                f"{fmt(p.get('mean_verified_width'), '.1f')} | {fmt(p.get('tau'), '.2f')} |"
            )
        lines.append("")
    if report.get("mismatches"):
        lines += [
            "### Greedy outputs that differ from plain generate()",
            "",
            "| dataset | prompt | method | repeat | first differing token | new tokens (method / baseline) |",
            "|---|---:|---|---:|---:|---|",
        ]
        for m in report["mismatches"]:
            lines.append(
                f"| {m['dataset']} | {m['prompt_index']} | {labels.get(m['method'], m['method'])} | {m['repeat']} | "
                f"{m['first_difference']} | {m['new_tokens']} / {m['baseline_new_tokens']} |"
            )
        lines.append("")
    else:
        lines += ["Greedy check: every method's output equals plain generate()'s on every prompt.", ""]
    if report.get("skipped"):
        lines += ["Not run: " + "; ".join(f"{k} ({v})" for k, v in report["skipped"].items()) + ".", ""]
    notes = {name: info["note"] for name, info in report["methods"].items() if info.get("note")}
    if notes:
        lines += ["Methods: " + "; ".join(f"{labels[k]}: {v}" for k, v in notes.items()) + ".", ""]
    lines += [
        "tokens/s and TPOT: total new tokens over total wall time (prefill included). speedup: tokens/s over plain "
        "generate()'s. tau: mean tokens committed per target forward after the prefill. r = tau / speedup: the cost "
        "of one speculative step in plain decoding steps (1.0 = no overhead)."
        + (
            " speedup per repeat: the same ratio for each repeat k (every prompt's k-th run against plain "
            "generate()'s k-th run, timed beside it), median and range over the repeats."
            if per_repeat
            else ""
        )
        + (
            " modelled: the same with each run's time taken from the fixed step costs (the table's cost of the "
            "steps it took), so that it does not move with machine noise."
            if modelled
            else ""
        ),
        "",
    ]
    return "\n".join(lines)


def plot_report(report: Mapping[str, Any], path: str | os.PathLike) -> bool:
    """PNG with the acceptance-length histograms and the speedup per dataset. False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = report["summary"]
    labels = {name: info["label"] for name, info in report["methods"].items()}
    datasets = [d for d in report["settings"]["datasets"]]
    several = len(datasets) > 1
    temperatures = sorted({r["temperature"] for r in rows})
    methods = [m for m in report["methods"] if m != "baseline"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))

    ax = axes[0]
    hist_rows = [
        r
        for r in rows
        if r["method"] in methods
        and r["temperature"] == temperatures[0]
        and r["dataset"] == ("all" if several else datasets[0])
        and r["acceptance_histogram"]
    ]
    if hist_rows:
        width_all = max(max(r["acceptance_histogram"]) for r in hist_rows)
        bar_width = 0.8 / len(hist_rows)
        for k, r in enumerate(hist_rows):
            h = r["acceptance_histogram"]
            steps = sum(h.values()) or 1
            xs = [n + (k - (len(hist_rows) - 1) / 2) * bar_width for n in range(1, width_all + 1)]
            ax.bar(
                xs,
                [h.get(n, 0) / steps for n in range(1, width_all + 1)],
                width=bar_width,
                label=f"{labels.get(r['method'], r['method'])} (tau {fmt(r['tau'], '.2f')})",
            )
        ax.set_xticks(range(1, width_all + 1))
        ax.legend(fontsize=8)
    ax.set_xlabel("tokens committed per verification step")
    ax.set_ylabel("fraction of steps")
    ax.set_title(f"Acceptance lengths (T={temperatures[0]:g}, {'all datasets' if several else datasets[0]})")

    ax = axes[1]
    groups = [(d, t) for d in datasets for t in temperatures]
    bar_width = 0.8 / max(1, len(methods))
    for k, method in enumerate(methods):
        values = []
        for d, t in groups:
            match = [r for r in rows if r["method"] == method and r["dataset"] == d and r["temperature"] == t]
            values.append(match[0]["speedup"] if match and math.isfinite(match[0]["speedup"]) else 0.0)
        xs = [i + (k - (len(methods) - 1) / 2) * bar_width for i in range(len(groups))]
        ax.bar(xs, values, width=bar_width, label=labels.get(method, method))
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{d}\nT={t:g}" for d, t in groups], fontsize=8)
    ax.set_ylabel("speedup over plain generate()")
    ax.set_title("Speedup per dataset")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def json_safe(value):
    """`value` with NaN and infinities as None (JSON has no such numbers) and dict keys as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_report(report: Mapping[str, Any], output_dir: str | os.PathLike, name: str = "bench") -> dict[str, Path]:
    """Write `<name>.json`, `<name>.md` and (with matplotlib) `<name>.png` into `output_dir`; return their paths."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{name}.json", "markdown": out / f"{name}.md"}
    paths["json"].write_text(json.dumps(json_safe(report), indent=1) + "\n", encoding="utf-8")
    markdown = format_markdown(report)
    png = out / f"{name}.png"
    if plot_report(report, png):
        paths["png"] = png
        markdown += f"\n![acceptance and speedup]({png.name})\n"
    paths["markdown"].write_text(markdown, encoding="utf-8")
    return paths
