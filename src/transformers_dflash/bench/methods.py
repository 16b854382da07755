"""The decoding methods a benchmark compares, as a registry: each entry says its name, its label, what it needs to
run here and how it generates.

A method's generate function is `generate(input_ids, kwargs) -> (sequences, acceptance or None)`, where `kwargs` are
the common `generate()` arguments (attention mask, max_new_tokens, sampling settings, pad id) and acceptance lists
the tokens committed per target forward, prefill first, like `drafter.last_acceptance_lengths`. With fixed step costs
(`fixed_costs.py`), a generate function also has `modelled_seconds`: what the table says its last call's steps cost
(None where it cannot say, e.g. a method that does not choose widths by cost).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .assisted import AssistedRecorder
from .builtin import builtin_dflash_available, to_builtin_drafter
from .drafter import draft_length, draft_length_memory, fast_cpu_linears, ngram_lookup

if TYPE_CHECKING:  # fixed_costs imports torch; `dflash bench --help` must not
    from .fixed_costs import StepCosts

DEFAULT_METHODS = ("baseline", "dflash", "dflash_adaptive", "builtin_dflash", "prompt_lookup")
# The *_skinny / dflash_stock_linears methods attribute speed to kernels: every method with the same CPU kernels
# (`kernels.cpu_kernels`: skinny linears and packed grouped-query attention).
OPTIONAL_METHODS = (
    "dflash_defaults",
    "dflash_lookup",
    "early_exit",
    "assistant",
    "baseline_skinny",
    "prompt_lookup_skinny",
    "dflash_stock_linears",
)
BATCH_METHODS = (
    "baseline",
    "dflash",
    "dflash_defaults",
    "dflash_adaptive",
    "dflash_lookup",
    "baseline_skinny",
    "dflash_stock_linears",
)
PLAIN_METHODS = ("baseline", "baseline_skinny")  # no drafter: tau is 1 by definition

Generate = Callable[[Any, dict], tuple[Any, "list[int] | None"]]


@dataclass
class Method:
    """A decoding method ready to time: `generate(input_ids, kwargs) -> (sequences [1, prompt + new], acceptance or
    None)` (see the module docstring)."""

    name: str
    label: str
    generate: Generate
    note: str = ""


@dataclass
class MethodContext:
    """What the methods are built from: the models and the settings of `build_methods`."""

    target: Any
    drafter: Any = None
    builtin_drafter: Any = None
    prompt_lookup_tokens: int = 10
    max_matching_ngram_size: int | None = None
    early_exit_layer: int | None = None
    assistant_model: Any = None
    adaptive_draft_length: Any = "auto"
    step_costs: StepCosts | None = None  # fixed step costs for "auto" (None: it measures its own)

    @property
    def lookup_size(self) -> int:
        """The n-gram size of prompt lookup (transformers' default: 2)."""
        return self.max_matching_ngram_size or 2

    @property
    def block(self) -> str:
        return f"block {self.drafter.config.block_size}"


@dataclass(frozen=True)
class MethodSpec:
    """One registry entry. `missing(context)` says why the method cannot run here (None: it can);
    `build(context)` returns its generate function and a note for the report."""

    name: str
    label: str
    build: Callable[[MethodContext], tuple[Generate, str]]
    missing: Callable[[MethodContext], str | None] = lambda context: None


# ------------------------------------------------------------------------------------------- how methods generate


def _plain(context: MethodContext) -> Generate:
    costs = context.step_costs

    def generate(ids, kwargs):
        out = context.target.generate(ids, **kwargs)
        if costs is not None:  # one plain step per token after the prefill's
            sequences = out.sequences if hasattr(out, "sequences") else out
            generate.modelled_seconds = max(sequences.shape[1] - ids.shape[1] - 1, 0) * costs.verify(1)
        return out, None

    generate.modelled_seconds = None
    return generate


def _with_cpu_kernels(target, generate: Generate) -> Generate:
    """`generate` with the CPU kernels DFlash decoding uses (`cpu_kernels`: skinny linears, packed attention)."""
    from ..kernels import cpu_kernels

    def wrapped(ids, kwargs):
        with cpu_kernels(target):
            return generate(ids, kwargs)

    return wrapped


def _assisted(target, extra: dict) -> Generate:
    """transformers' own assisted `generate()` with `extra` arguments, recording what it accepted."""

    def generate(input_ids, kwargs):
        recorder = AssistedRecorder()
        with recorder.watch():
            out = target.generate(input_ids, **kwargs, **extra)
        return out, recorder.acceptance

    return generate


def _dflash(context: MethodContext, setting, fast_linears: bool = True, lookup: int | None = 0) -> Generate:
    """Our DFlash path with the drafter's draft length, kernels and copied drafts set for the call, and its own
    memory of what "auto" and the copies measured in this method's earlier calls."""
    from ..draft_length import default_draft_length
    from .fixed_costs import fixed_cost_policy, seed_memory

    target, drafter = context.target, context.drafter
    memory = {}
    device = target.get_input_embeddings().weight.device  # where verification runs, as the generator decides
    fixed = context.step_costs is not None and (setting or default_draft_length(device)) == "auto"

    def generate(ids, kwargs):
        if fixed:
            seed_memory(memory, context.step_costs, drafter, batch_size=ids.shape[0])
            before = fixed_cost_policy(memory).modelled_seconds
        with draft_length(drafter, setting), fast_cpu_linears(drafter, fast_linears), ngram_lookup(drafter, lookup):
            with draft_length_memory(drafter, memory):
                out = target.generate(ids, assistant_model=drafter, **kwargs)
        if fixed:
            generate.modelled_seconds = fixed_cost_policy(memory).modelled_seconds - before
        return out, list(drafter.last_acceptance_lengths)

    generate.modelled_seconds = None
    return generate


def _prompt_lookup(context: MethodContext) -> tuple[Generate, str]:
    extra = {"prompt_lookup_num_tokens": context.prompt_lookup_tokens}
    if context.max_matching_ngram_size is not None:
        extra["max_matching_ngram_size"] = context.max_matching_ngram_size
    note = f"{context.prompt_lookup_tokens} tokens, n-gram <= {context.lookup_size}"
    return _assisted(context.target, extra), note


def _num_target_layers(target) -> int:
    from ..target_model import text_config

    return int(text_config(target.config).num_hidden_layers)


def _early_exit_layer(context: MethodContext) -> tuple[int, int]:
    """(the layer the early-exit draft stops at, the target's depth): a quarter of the way down unless set."""
    num_layers = _num_target_layers(context.target)
    layer = context.early_exit_layer if context.early_exit_layer is not None else max(1, num_layers // 4)
    return layer, num_layers


def _builtin_dflash(context: MethodContext) -> tuple[Generate, str]:
    converted = context.builtin_drafter if context.builtin_drafter is not None else to_builtin_drafter(context.drafter)
    _, version = builtin_dflash_available()
    generate = _assisted(context.target, {"assistant_model": converted, "speculation_type": "dflash"})
    return generate, f"{version}, MuseGlimmerAssistantModel with the same weights"


# ------------------------------------------------------------------------------------------- what methods need


def _needs_drafter(setting: str | None = None, missing: str = ""):
    """A `missing` check: a drafter is given, and its code has the run-time `setting` (when named)."""

    def check(context: MethodContext) -> str | None:
        if context.drafter is None:
            return "no drafter given"
        if setting is not None and not hasattr(context.drafter, setting):
            return missing
        return None

    return check


def _needs_builtin_path(context: MethodContext) -> str | None:
    available, reason = builtin_dflash_available()
    if context.drafter is None:
        return "no drafter given"
    return None if available else reason


def _needs_early_exit_layer(context: MethodContext) -> str | None:
    layer, num_layers = _early_exit_layer(context)
    return None if 0 < layer < num_layers else f"early-exit layer {layer} is not within 1..{num_layers - 1}"


def _needs_assistant(context: MethodContext) -> str | None:
    return None if context.assistant_model is not None else "no --assistant-model given"


# ------------------------------------------------------------------------------------------- the registry


def _early_exit(context: MethodContext) -> tuple[Generate, str]:
    layer, num_layers = _early_exit_layer(context)
    generate = _assisted(context.target, {"assistant_early_exit": layer})
    return generate, f"drafts with the target's first {layer} of {num_layers} layers"


def _adaptive(context: MethodContext) -> tuple[Generate, str]:
    setting = context.adaptive_draft_length
    return _dflash(context, setting), f"{context.block}, draft_length={setting!r}"


def _dflash_lookup(context: MethodContext) -> tuple[Generate, str]:
    from ..ngram_lookup import default_ngram_lookup

    setting = context.adaptive_draft_length or "auto"
    # Copies on every device (the defaults turn them off on accelerators), of the length the CPU default uses unless
    # --max-matching-ngram-size says otherwise.
    size = context.max_matching_ngram_size or default_ngram_lookup("cpu")
    generate = _dflash(context, setting, lookup=size)
    return generate, f"{context.block}, draft_length={setting!r}, ngram_lookup={size}"


def _prompt_lookup_skinny(context: MethodContext) -> tuple[Generate, str]:
    generate, note = _prompt_lookup(context)
    return _with_cpu_kernels(context.target, generate), note


REGISTRY: dict[str, MethodSpec] = {
    spec.name: spec
    for spec in (
        MethodSpec("baseline", "plain generate()", lambda c: (_plain(c), "")),
        MethodSpec("dflash", "DFlash (transformers-dflash)", lambda c: (_dflash(c, "full"), c.block), _needs_drafter()),
        MethodSpec(
            "dflash_adaptive",
            "DFlash, adaptive draft length (transformers-dflash)",
            _adaptive,
            _needs_drafter("draft_length", "this drafter's code has no adaptive draft length"),
        ),
        MethodSpec("builtin_dflash", "DFlash (transformers built-in)", _builtin_dflash, _needs_builtin_path),
        MethodSpec("prompt_lookup", "prompt lookup", _prompt_lookup),
        MethodSpec(
            "dflash_defaults",
            "DFlash at the drafter's defaults (transformers-dflash)",
            lambda c: (_dflash(c, None, lookup=None), f"{c.block}, nothing set: the device's defaults"),
            _needs_drafter("ngram_lookup", "this drafter's code has no device defaults"),
        ),
        MethodSpec(
            "dflash_lookup",
            "DFlash + n-gram lookup, adaptive draft length (transformers-dflash)",
            _dflash_lookup,
            _needs_drafter("ngram_lookup", "this drafter's code has no ngram_lookup"),
        ),
        MethodSpec("early_exit", "early-exit self-speculation", _early_exit, _needs_early_exit_layer),
        MethodSpec(
            "assistant",
            "assistant model",
            lambda c: (_assisted(c.target, {"assistant_model": c.assistant_model}), type(c.assistant_model).__name__),
            _needs_assistant,
        ),
        MethodSpec(
            "baseline_skinny",
            "plain generate(), DFlash's CPU kernels",
            lambda c: (_with_cpu_kernels(c.target, _plain(c)), ""),
        ),
        MethodSpec("prompt_lookup_skinny", "prompt lookup, DFlash's CPU kernels", _prompt_lookup_skinny),
        MethodSpec(
            "dflash_stock_linears",
            "DFlash (transformers-dflash), stock kernels",
            lambda c: (_dflash(c, "full", fast_linears=False), f"{c.block}, fast_cpu_linears=False"),
            _needs_drafter("fast_cpu_linears", "this drafter's code has no fast_cpu_linears"),
        ),
    )
}
METHOD_LABELS = {name: spec.label for name, spec in REGISTRY.items()}


def build_methods(
    target,
    drafter=None,
    names: Sequence[str] = DEFAULT_METHODS,
    *,
    builtin_drafter=None,
    prompt_lookup_tokens: int = 10,
    max_matching_ngram_size: int | None = None,
    early_exit_layer: int | None = None,
    assistant_model=None,
    adaptive_draft_length="auto",
    step_costs: StepCosts | None = None,
) -> tuple[list[Method], dict[str, str]]:
    """The requested methods that can run here, and `{name: reason}` for those that cannot. `step_costs`: fixed
    costs for every method that chooses widths with "auto" (and for plain decoding's modelled time)."""
    context = MethodContext(
        target,
        drafter,
        builtin_drafter,
        prompt_lookup_tokens,
        max_matching_ngram_size,
        early_exit_layer,
        assistant_model,
        adaptive_draft_length,
        step_costs,
    )
    methods, skipped = [], {}
    for name in names:
        spec = REGISTRY.get(name)
        if spec is None:
            raise ValueError(f"unknown method {name!r}; choose from {DEFAULT_METHODS + OPTIONAL_METHODS}")
        reason = spec.missing(context)
        if reason is not None:
            skipped[name] = reason
            continue
        generate, note = spec.build(context)
        methods.append(Method(name, spec.label, generate, note))
    return methods, skipped
