"""The single-stream benchmark: every method on every prompt, one prompt per `generate()` call, interleaved."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from ..runtime import encode_chat, synchronize
from .builtin import builtin_dflash_available, compare_drafts, to_builtin_drafter
from .methods import DEFAULT_METHODS, Method, build_methods
from .metrics import Sample, find_mismatches, relative_rate, summarize
from .profile import profile_step
from .progress import progress_bar
from .report import environment

UNTRAINED_NOTE = (
    "The drafter is UNTRAINED (random weights): almost no draft is accepted, so tau is near 1 and both DFlash paths "
    "are SLOWER than plain generate(). These numbers measure the per-step overhead, not DFlash's speedup."
)


def encode_prompt(tokenizer, prompt, device, chat_template_kwargs=None):
    """[1, seq] ids of one prompt: token ids as given, or text through the tokenizer's chat template (with
    `chat_template_kwargs` as its extra variables)."""
    import torch

    if isinstance(prompt, torch.Tensor):
        ids = prompt if prompt.dim() == 2 else prompt[None]
        return ids.to(device)
    if not isinstance(prompt, str):
        return torch.tensor([list(prompt)], device=device)
    if tokenizer is None:
        raise ValueError("text prompts need a tokenizer; pass tokenizer=... or token id lists")
    return encode_chat(tokenizer, prompt, device, chat_template_kwargs)


def _generate_kwargs(input_ids, max_new_tokens: int, temperature: float, pad_token_id) -> dict:
    import torch

    kwargs = dict(attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens, pad_token_id=pad_token_id)
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=float(temperature), top_k=0, top_p=1.0)
    else:
        kwargs.update(do_sample=False)
    return kwargs


def _pad_token_id(tokenizer, target) -> int:
    """The tokenizer's pad (else EOS) id, else the target's generation config's pad (else first EOS, else 0)."""
    pad_token_id = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    if pad_token_id is None:
        pad_token_id = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if pad_token_id is None:
        eos = target.generation_config.eos_token_id
        pad_token_id = target.generation_config.pad_token_id
        if pad_token_id is None:
            pad_token_id = eos[0] if isinstance(eos, list) else (eos if eos is not None else 0)
    return pad_token_id


def _timed(method: Method, ids, kwargs: dict, sample_seed: int | None, device) -> tuple[list[int], Any, float]:
    """One run of `method`: its new tokens, its acceptance lengths and its wall time (sampling reseeded first); the
    run's modelled seconds (fixed step costs) are then `method.generate.modelled_seconds`."""
    import torch

    if sample_seed is not None:
        torch.manual_seed(sample_seed)
    synchronize(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out, acceptance = method.generate(ids, kwargs)
    synchronize(device)
    seconds = time.perf_counter() - start
    sequences = out.sequences if hasattr(out, "sequences") else out
    return sequences[0, ids.shape[1] :].tolist(), acceptance, seconds


def _time_methods(
    method_list, encoded, temperatures, repeats, warmup, seed, max_new_tokens, pad_token_id, device, bar
) -> list[Sample]:
    """Warm-up runs per method and temperature, then `repeats` timed runs per prompt, interleaved in an order rotated
    from prompt to prompt (so machine noise hits all methods alike)."""
    samples: list[Sample] = []
    rotation = 0
    first_ids = next(iter(encoded.values()))[0]
    for temperature in temperatures:

        def run(method, ids, sample_seed):
            kwargs = _generate_kwargs(ids, max_new_tokens, temperature, pad_token_id)
            return _timed(method, ids, kwargs, sample_seed if temperature > 0 else None, device)

        for method in method_list:
            for _ in range(warmup):
                bar.set_postfix_str(f"warm-up {method.name} T={temperature:g}")
                run(method, first_ids, seed)
                bar.update()
        for dataset, prompts in encoded.items():
            for index, ids in enumerate(prompts):
                order = method_list[rotation % len(method_list) :] + method_list[: rotation % len(method_list)]
                rotation += 1
                for repeat in range(repeats):
                    for method in order:
                        bar.set_postfix_str(f"{dataset} #{index} {method.name} T={temperature:g}")
                        output, acceptance, seconds = run(method, ids, seed * 1_000_003 + index * 101 + repeat)
                        modelled = getattr(method.generate, "modelled_seconds", None)
                        samples.append(
                            Sample(
                                method=method.name,
                                dataset=dataset,
                                temperature=temperature,
                                prompt_index=index,
                                repeat=repeat,
                                prompt_tokens=int(ids.shape[1]),
                                new_tokens=len(output),
                                seconds=seconds,
                                acceptance=list(acceptance) if acceptance is not None else None,
                                output=output,
                                modelled_seconds=modelled,
                            )
                        )
                        bar.update()
    return samples


def _notes(drafter, drafter_trained, mismatches, builtin_drafter, skipped) -> list[str]:
    """What a reader of the report must know to read its numbers right."""
    notes = []
    if drafter is not None and drafter_trained is False:
        notes.append(UNTRAINED_NOTE)
    if mismatches:
        notes.append(
            f"{len(mismatches)} greedy run(s) differ from plain generate(): see `mismatches`. In float32/bfloat16 a "
            "block verification may round differently from one-token decoding and flip a near-tie; in float64 any "
            "difference is a bug."
        )
    if builtin_drafter is not None and getattr(drafter, "draft_vocab_ids", None) is not None:
        notes.append(
            f"The drafter drafts from a reduced vocabulary ({drafter.config.draft_vocab_size} tokens); transformers' "
            "built-in DFlash path has no such option, so it gets the same layer weights but scores the whole "
            "vocabulary: its drafts (and tau) can differ from ours, and its draft step pays for the full LM head."
        )
    if "builtin_dflash" in skipped:
        notes.append(f"transformers' built-in DFlash path was not run: {skipped['builtin_dflash']}.")
    return notes


# Compared head to head whenever both run: ours against the built-in path and against prompt lookup.
_BUILTIN_COMPARISONS = [
    (ours, other)
    for other in ("builtin_dflash", "prompt_lookup")
    for ours in ("dflash", "dflash_adaptive", "dflash_lookup")
]


def run_benchmark(
    target,
    drafter=None,
    *,
    datasets: Mapping[str, Sequence[Any]],
    tokenizer=None,
    methods: Sequence[str] = DEFAULT_METHODS,
    extra_methods: Sequence[Method] = (),
    comparisons: Sequence[tuple[str, str]] = (),
    temperatures: Sequence[float] = (0.0, 1.0),
    max_new_tokens: int = 64,
    repeats: int = 1,
    warmup: int = 1,
    seed: int = 0,
    prompt_lookup_tokens: int = 10,
    max_matching_ngram_size: int | None = None,
    early_exit_layer: int | None = None,
    assistant_model=None,
    adaptive_draft_length="auto",
    step_costs=None,
    check_drafts: bool = True,
    profile: bool = False,
    progress: bool = True,
    drafter_description: str | None = None,
    drafter_trained: bool | None = None,
    settings: Mapping[str, Any] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> dict:
    """Time every method on every prompt of every dataset, at every temperature, in this one process.

    datasets: `{name: prompts}`; a prompt is text (the tokenizer's chat template is applied, with
    `chat_template_kwargs` such as `{"enable_thinking": False}` as its extra variables) or token ids.
    methods: names among `DEFAULT_METHODS + OPTIONAL_METHODS`; `baseline` is always run (speedups need it).
    extra_methods: more `Method`s (e.g. your own decoding loop), timed and checked like the others.
    comparisons: `(method, other)` name pairs to compare head to head (`relative_rate`: pooled and per repeat), beside
    the built-in ones (ours against the built-in path and prompt lookup); e.g. `[("mine", "dflash")]`.
    step_costs: a `fixed_costs.StepCosts` that every "auto" method chooses widths from instead of its own timing, so
    that drafters are compared by their drafts alone (the summary then has modelled rates beside the measured ones).
    Per temperature, every method first runs `warmup` untimed times on the first prompt; then, prompt by prompt,
    each method runs `repeats` timed times, interleaved, in an order rotated from prompt to prompt. Sampling
    (temperature > 0: pure sampling, top_k=0, top_p=1) reseeds torch with the same seed for every method.

    Returns the report: settings, environment, methods, skipped methods, samples, summary rows, mismatches,
    ours-vs-built-in comparisons and notes; `write_report` turns it into JSON, Markdown and PNG.
    """
    names = list(dict.fromkeys(["baseline", *methods]))
    builtin_drafter = None
    if drafter is not None and "builtin_dflash" in names and builtin_dflash_available()[0]:
        builtin_drafter = to_builtin_drafter(drafter)
    method_list, skipped = build_methods(
        target,
        drafter,
        names,
        builtin_drafter=builtin_drafter,
        prompt_lookup_tokens=prompt_lookup_tokens,
        max_matching_ngram_size=max_matching_ngram_size,
        early_exit_layer=early_exit_layer,
        assistant_model=assistant_model,
        adaptive_draft_length=adaptive_draft_length,
        step_costs=step_costs,
    )
    method_list += list(extra_methods)
    taken = [m.name for m in method_list]
    if len(set(taken)) != len(taken):
        raise ValueError(f"method names must be unique, got {taken}")
    comparisons = [tuple(pair) for pair in comparisons]
    unknown = sorted({name for pair in comparisons for name in pair} - set(taken))
    if unknown or any(len(pair) != 2 for pair in comparisons):
        raise ValueError(
            f"comparisons must be (method, other) pairs of the methods that run ({', '.join(taken)}); "
            f"got {comparisons}" + (f", which names {', '.join(unknown)}" if unknown else "")
        )

    device = next(target.parameters()).device
    pad_token_id = _pad_token_id(tokenizer, target)
    template_kwargs = dict(chat_template_kwargs or {})
    encoded = {
        name: [encode_prompt(tokenizer, p, device, template_kwargs) for p in prompts]
        for name, prompts in datasets.items()
    }
    encoded = {name: ids for name, ids in encoded.items() if ids}
    if not encoded:
        raise ValueError("no prompts to benchmark")
    temperatures = [float(t) for t in temperatures]
    num_prompts = sum(len(v) for v in encoded.values())
    check = (
        check_drafts
        and builtin_drafter is not None
        and any(m.name in ("dflash", "builtin_dflash") for m in method_list)
    )
    to_profile = (
        [m.name for m in method_list if m.name in ("dflash", "dflash_adaptive", "builtin_dflash")] if profile else []
    )
    if "builtin_dflash" in to_profile and builtin_drafter is None:
        to_profile.remove("builtin_dflash")
    total = len(temperatures) * len(method_list) * (warmup + repeats * num_prompts) + (1 if check else 0)
    total += len(to_profile)
    bar = progress_bar(progress, total)

    started = time.perf_counter()
    try:
        samples = _time_methods(
            method_list, encoded, temperatures, repeats, warmup, seed, max_new_tokens, pad_token_id, device, bar
        )
        draft_check = None
        if check:
            bar.set_postfix_str("ours vs built-in drafts")
            draft_check = compare_drafts(
                target,
                drafter,
                builtin_drafter,
                next(iter(encoded.values()))[0],
                max_new_tokens,
                pad_token_id=pad_token_id,
            )
            bar.update()
        profiles = {}
        for name in to_profile:
            bar.set_postfix_str(f"profiling {name}")
            profiles[name] = profile_step(
                target,
                drafter,
                next(iter(encoded.values()))[0],
                name,
                builtin_drafter,
                max_new_tokens,
                adaptive_draft_length,
                pad_token_id=pad_token_id,
            )
            bar.update()
    finally:
        bar.close()
    elapsed = time.perf_counter() - started

    block_size = getattr(getattr(drafter, "config", None), "block_size", None)
    max_len = max([block_size or 1] + [prompt_lookup_tokens + 1] + [n for s in samples for n in (s.acceptance or [1])])
    mismatches = find_mismatches(samples)
    rows = summarize(samples, max_length=max_len, mismatches=mismatches)
    notes = _notes(drafter, drafter_trained, mismatches, builtin_drafter, skipped)
    report = {
        "settings": {
            "datasets": {name: len(ids) for name, ids in encoded.items()},
            "methods": [m.name for m in method_list],
            "temperatures": temperatures,
            "max_new_tokens": max_new_tokens,
            "repeats": repeats,
            "warmup": warmup,
            "seed": seed,
            "prompt_lookup_tokens": prompt_lookup_tokens,
            "block_size": block_size,
            "adaptive_draft_length": adaptive_draft_length,
            "fixed_step_costs": step_costs.to_dict() if step_costs is not None else None,
            "drafter": drafter_description,
            "drafter_trained": drafter_trained,
            "chat_template_kwargs": template_kwargs,
            **dict(settings or {}),
        },
        "environment": environment(device),
        "methods": {m.name: {"label": m.label, "note": m.note} for m in method_list},
        "skipped": skipped,
        "summary": rows,
        "comparisons": [
            {"method": ours, "other": other, "rows": found}
            for ours, other in _BUILTIN_COMPARISONS + [pair for pair in comparisons if pair not in _BUILTIN_COMPARISONS]
            if (found := relative_rate(rows, ours, other))
        ],
        "draft_check": draft_check,
        "step_profile": profiles,
        "mismatches": mismatches,
        "notes": notes,
        "elapsed_s": elapsed,
        "samples": [s.to_dict() for s in samples],
    }
    return report
