"""A drafter's run-time settings, set for one measurement and restored after it, and the copy of the core its class
comes from (ours, or a checkpoint's own under trust_remote_code)."""

from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def drafter_setting(drafter, name: str, value, default):
    """Temporarily set the run-time setting `drafter.<name>` to `value`.

    A drafter whose code predates the setting behaves as `default`: asking it for `default` changes nothing, asking it
    for anything else is an error (the method cannot run with that drafter)."""
    if not hasattr(drafter, name):
        if value == default:
            yield drafter
            return
        raise ValueError(f"this drafter's code has no {name} setting (drafter.{name})")
    previous = getattr(drafter, name)
    setattr(drafter, name, value)
    try:
        yield drafter
    finally:
        setattr(drafter, name, previous)


def draft_length(drafter, setting):
    """Temporarily set `drafter.draft_length` ("full": verify the whole block; a threshold; "auto"; None: the device's
    default)."""
    return drafter_setting(drafter, "draft_length", setting, "full")


def fast_cpu_linears(drafter, enabled: bool):
    """Temporarily set `drafter.fast_cpu_linears` (False: verify and draft with stock `nn.Linear` kernels)."""
    return drafter_setting(drafter, "fast_cpu_linears", enabled, True)


def ngram_lookup(drafter, size):
    """Temporarily set `drafter.ngram_lookup` (0: off; None: the device's default)."""
    return drafter_setting(drafter, "ngram_lookup", size, 0)


def draft_length_memory(drafter, memory: dict):
    """Temporarily make `memory` what the drafter's "auto" and copied drafts carry from call to call
    (`drafter.draft_length_memory`), so that each benchmarked method learns from its own calls only. A drafter whose
    code predates the memory carries nothing, and is left as it is."""
    return drafter_setting(drafter, "draft_length_memory", memory, memory)


def parse_draft_length(text):
    """`--draft-length` values: "auto", "full" (or "none": the whole block) or a confidence threshold in [0, 1]."""
    if text is None or str(text).lower() in ("none", "full"):
        return "full"
    if str(text).lower() == "auto":
        return "auto"
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"draft length threshold must be in [0, 1], got {value}")
    return value


def core_module(drafter, name: str):
    """The core file `name` of the copy of the core that `drafter`'s class comes from (ours, or a checkpoint's
    own under trust_remote_code)."""
    package = sys.modules[type(drafter).__module__].__package__
    return sys.modules[f"{package}.{name}"]
