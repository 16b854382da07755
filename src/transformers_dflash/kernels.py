"""CPU kernels for the few-row products of speculative decoding (part of the carried core: torch and transformers only).

A verification forward multiplies every weight matrix by a handful of rows (block width x batch) and, at batch > 1,
attends with a mask. On CPUs both hit slow paths of the stock kernels; the two context managers here route them to
faster formulations of the same arithmetic. Neither is DFlash-specific: `with cpu_kernels(model): model.generate(...)`
gives plain decoding the same kernels. Measurements: docs/benchmarks.md ("Linear kernels", "Batched").
"""

import contextlib
import copy
import functools
import glob
import itertools
import math
import time
import weakref
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.nn import functional as F

from .kernel_choices import choices_file, describe_machine, load_choices, save_choices

# Row counts for which `skinny_linear` considers other products than `F.linear`: verification widths x batch rows,
# short prefills (a longer product keeps `F.linear`).
_MAX_ROWS = 256
# Another product is chosen only when it measured at least this much faster: a near tie keeps `F.linear`, which is
# bit for bit what plain decoding computes.
_MARGIN = 0.9
# ... and saved at least this much per call: a layer that takes another product for any row count goes through
# `skinny_linear` for all of them, a detour of 6.6 us per call on a 2-core Xeon. SmolLM2's layer shapes there were
# near ties of 15-150 us whose noise chose the transposed product for a row count or two in some processes and
# slowed every step by the detours (2-4 %); on a 2-core EPYC the transposed product saved 30-100 us per call.
_MIN_SAVING_SECONDS = 10e-6
# The packed product keeps a second copy of its weight in memory, so it must also beat the best product that needs
# none by this much.
_PACKED_MARGIN = 0.75
# The weight layout oneDNN is told to expect row counts up to (a hint: any row count works). On a 2-core Intel Xeon
# the LM head took about the same time packed for 8 or 16 (docs/benchmarks.md, "oneDNN's packed weights").
_PACKED_ROWS_HINT = 16
_MEASURE_REPEATS = 3  # timed runs of each kernel per measurement (after one untimed run), the fastest counts
# Each timed run reads a weight that is not in the CPU's caches, as in a forward, where the rest of the model has
# passed through them since a layer's last use: copies of the weight together this many times the last-level cache.
_COLD_CACHE_MULTIPLE = 2
_DEFAULT_CACHE_BYTES = 32 * 2**20  # where the OS does not say (Linux's sysfs does)
_MAX_COLD_BYTES = 256 * 2**20  # at most this much in copies: a cache larger than that holds much of a small model
# And at most this many: a weight so small that it takes more (a few KiB) is timed by the call's overhead, not its
# reads, and copying and packing it 10^5 times took seconds. SmolLM2's smallest weight takes 607 copies of 256 MiB.
_MAX_COLD_COPIES = 1024
# (out_features, in_features, row bucket, torch threads) -> the product measured fastest: "linear" (`F.linear`),
# "transposed" (`transposed_linear`) or "packed" (`packed_linear`). Starts from the choices an earlier process on this
# machine measured (`kernel_choices`), read on first need.
_kernel_choice: dict[tuple[int, int, int, int], str] = {}
_UNREAD = object()
# (the file this process read and adds its choices to, the machine it describes); None: turned off. Looked up once.
_choices_file = _UNREAD
_measuring_seconds = 0.0  # wall time spent measuring kernels and packing weights, left out of `step_clock`
# id(weight) -> (the weight's version counter when packed, its packed copy); an entry goes with its weight.
_packed_weights: dict[int, tuple[int, torch.Tensor]] = {}


def skinny_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(input, weight, bias)`, or the same product computed another way where that was measured faster on
    this machine, for a few float32 rows on a CPU: transposed (`transposed_linear`) or by oneDNN on a copy of the
    weight in its own blocked layout (`packed_linear`).

    Which one is faster depends on the CPU and its BLAS, the weight's shape, the row count and torch's thread count,
    and not in one direction (docs/benchmarks.md, "a 2-core Intel Xeon, where the EPYC's kernel rule was a loss"):
    on a 2-core AMD EPYC the transposed product streamed the weights once where MKL's GEMM took 1.6-1.8x a one-row
    product for 2..16 rows; on a 2-core Intel Xeon with AVX-512 it was 1.1-2.8x SLOWER than `F.linear` for most
    shapes up to 4 rows, and there MKL took 3.3x its one-row time for an LM head's 8 rows where the packed product
    took 1.3x. So each (weight shape, row count, thread count) is timed on its first input, the kernels interleaved
    (`_measure`; row counts above 8 share a power-of-two bucket), and the fastest one is used from then on, also by
    later processes on the same machine (`kernel_choices`). Same arithmetic, other summation order: results agree
    to float32 rounding, like any change of batch shape. Other devices, dtypes and row counts, and products that
    autograd must differentiate, take `F.linear`.
    """
    rows = input.numel() // input.shape[-1] if input.dim() > 0 and input.shape[-1] else 0
    if input.device.type != "cpu" or input.dtype != torch.float32:
        return F.linear(input, weight, bias)
    kernel = kernel_for(weight, rows, input)
    if kernel == "packed" and not (torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad)):
        return packed_linear(input, weight, bias)
    if kernel == "transposed":
        flat = input.reshape(rows, input.shape[-1])
        return transposed_linear(flat, weight, bias).view(*input.shape[:-1], weight.shape[0])
    return F.linear(input, weight, bias)


def kernel_for(
    weight: torch.Tensor, rows: int, input: torch.Tensor | None = None, cold: "ColdCopies | None" = None
) -> str:
    """The product that computes `rows` rows times this float32 CPU `weight` fastest with torch's thread count
    ("linear", "transposed" or "packed"): the measured choice (measured now, on `input` or on random rows, if neither
    this process nor an earlier one on this machine has measured such a product; `cold`: the weight's copies to
    measure on, where several row counts are measured in a row)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not 1 <= rows <= _MAX_ROWS:
        return "linear"
    bucket = rows if rows <= 8 else 1 << (rows - 1).bit_length()
    key = (weight.shape[0], weight.shape[1], bucket, torch.get_num_threads())
    # Every product asks: the choices in memory first, the file only on a miss (it is read once per process).
    kernel = _kernel_choice.get(key) or _remembered_choices().get(key)
    if kernel is None:
        flat = input.reshape(rows, -1) if input is not None else torch.randn(rows, weight.shape[1])
        kernel = _kernel_choice[key] = _measure(flat, weight, cold)
        if _choices_file is not None:
            save_choices(*_choices_file, {key: kernel})
    return kernel


def _remembered_choices() -> dict[tuple[int, int, int, int], str]:
    """`_kernel_choice`, with the choices of earlier processes on this machine added the first time it is asked."""
    global _choices_file
    if _choices_file is _UNREAD:
        machine = describe_machine(packing_available())
        path = choices_file(machine)
        _choices_file = None if path is None else (path, machine)
        for key, kernel in (load_choices(path) if path is not None else {}).items():
            _kernel_choice.setdefault(key, kernel)
    return _kernel_choice


def transposed_linear(flat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(flat, weight, bias)` for a 2-D input, computed as `(weight @ flat^T)^T`: one pass over the weight
    for all rows.

    One row goes as two copies of itself (a single row would send torch to the matrix-vector product again). The
    output is made contiguous again: leaving it transposed in memory saved the copy but slowed the ops after it more.
    """
    if flat.shape[0] == 1:
        output = torch.mm(weight, torch.cat([flat, flat]).t())[:, :1].t()
    else:
        output = torch.mm(weight, flat.t()).t()
    return (output + bias if bias is not None else output).contiguous()


def packed_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(input, weight, bias)` computed by oneDNN on `packed_weight(weight)`, a copy of the weight in oneDNN's
    blocked layout made on first use and kept while the weight lives (and unchanged). No gradients."""
    return _packed_product(input, packed_weight(weight), bias)


def _packed_product(input: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(input, packed, bias, "none", [], "")


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` in oneDNN's blocked layout for few-row products, made once and repacked if the weight has changed in
    place since (its version counter moved); the copy is dropped when the weight is freed. A weight made under
    `torch.inference_mode()` (e.g. the drafter's slice of the LM head, when generate() runs inside it) has no version
    counter, so its copy is kept as first made: such tensors are not trained or loaded into.

    Packing is left out of `step_clock`, as measuring is: it falls on the first step that verifies a width whose
    products are packed (an LM head: tens of ms), and counted in that step it made the width look several times
    dearer than it is, so that `"auto"` never verified it again (docs/benchmarks.md, 2026-12-07)."""
    global _measuring_seconds
    key = id(weight)
    version = None if weight.is_inference() else weight._version
    entry = _packed_weights.get(key)
    if entry is None or entry[0] != version:
        if entry is None:
            weakref.finalize(weight, _packed_weights.pop, key, None)
        start = time.perf_counter()
        entry = _packed_weights[key] = (version, _pack(weight))
        _measuring_seconds += time.perf_counter() - start
    return entry[1]


def _pack(weight: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACKED_ROWS_HINT)


@functools.cache
def packing_available() -> bool:
    """Whether this torch has oneDNN's packed linear (a private operator of its CPU builds, used by torch.compile's
    CPU backend) and it runs here. Checked once, on a small product against `F.linear`."""
    if not torch.backends.mkldnn.is_available() or not torch.backends.mkldnn.enabled:
        return False
    try:
        weight, flat = torch.randn(24, 16), torch.randn(3, 16)
        return bool(torch.allclose(_packed_product(flat, _pack(weight)), F.linear(flat, weight), atol=1e-4))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def bfloat16_is_fast(device) -> bool:
    """Whether bfloat16 matrix products run at full speed on `device`: a CUDA GPU that supports bfloat16, or a CPU
    with bfloat16 instructions: AMX tiles (Intel Sapphire Rapids and later) or AVX512-BF16 (AMD Zen 4 and later,
    Intel Cooper Lake). Other CPUs emulate bfloat16 at a cost.

    It picks the data commands' defaults: the target's dtype when `dflash regenerate` writes answers and autocast when
    `dflash train` trains a drafter (measured on a 2-core AMX Xeon and a 2-core AVX512-BF16 EPYC: docs/data-engines.md,
    docs/training.md); and whether a bfloat16 drafter beside a float32 target is worth a warning (candidate_generator).
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    # Private torch functions (2.1 and later): absent or failing, assume neither, the slower default being the safe one.
    for check in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        supported = getattr(getattr(torch, "cpu", None), check, None)
        try:
            if supported is not None and bool(supported()):
                return True
        except Exception:
            continue
    return False


@torch.no_grad()
def _measure(flat: torch.Tensor, weight: torch.Tensor, cold: "ColdCopies | None" = None) -> str:
    """The fastest product for this input and weight: each kernel runs once untimed, then `_MEASURE_REPEATS` times,
    the kernels alternating (their order rotates from run to run); the fastest run of each is compared.
    Another product must beat `F.linear` by `_MARGIN` and `_MIN_SAVING_SECONDS`; the packed product (where oneDNN has
    it) the better of the two others by `_PACKED_MARGIN` as well, since it keeps a copy of the weight.

    Each run reads the next copy of the weight from `cold` (default: `ColdCopies(weight)`), so that it comes from
    memory as in a forward, not from the cache that the run before filled: with the weight cached, `F.linear` and the
    transposed product were near ties for SmolLM2's layer shapes at 2-4 rows, and which one a process chose changed
    from process to process; read from memory, the transposed product took 0.3-0.7 of `F.linear`'s time there
    (docs/benchmarks.md, "Kernel choice with the weights out of cache")."""
    global _measuring_seconds
    start = time.perf_counter()
    cold = ColdCopies(weight) if cold is None else cold
    kernels = {"linear": (F.linear, cold.cycle()), "transposed": (transposed_linear, cold.cycle())}
    if packing_available():
        kernels["packed"] = (_packed_product, cold.cycle(packed=True))
    best = dict.fromkeys(kernels, math.inf)
    names = list(kernels)
    for repeat in range(_MEASURE_REPEATS + 1):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            kernel, copies = kernels[name]
            copy_of_weight = next(copies)
            began = time.perf_counter()
            kernel(flat, copy_of_weight)
            if repeat:
                best[name] = min(best[name], time.perf_counter() - began)
    _measuring_seconds += time.perf_counter() - start
    return _choose(best)


def _choose(seconds: dict[str, float]) -> str:
    """The product to use, from each one's measured `seconds` ("linear" always among them; see `_measure`)."""
    linear, chosen = seconds["linear"], "linear"
    for name in ("transposed", "packed"):  # the packed one last: it must beat the others by `_PACKED_MARGIN`
        time_taken = seconds.get(name, math.inf)
        beats_chosen = time_taken < (_PACKED_MARGIN if name == "packed" else 1.0) * seconds[chosen]
        if beats_chosen and time_taken < _MARGIN * linear and linear - time_taken > _MIN_SAVING_SECONDS:
            chosen = name
    return chosen


class ColdCopies:
    """`weight` and copies of it that together are `_COLD_CACHE_MULTIPLE` times the last-level cache (just `weight`
    where it is that large itself; at most `_MAX_COLD_BYTES` and `_MAX_COLD_COPIES`), made on first use and kept for
    the measurements of all the row counts of its shape; `cycle()` gives them in turn, endlessly, so that each has
    left the cache by the time it is read again (the copies made last are read last, after the first ones, which the
    later copies pushed out). `cycle(packed=True)` gives the same copies packed for oneDNN (`packed_linear`)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    @functools.cached_property
    def copies(self) -> list[torch.Tensor]:
        needed = min(_COLD_CACHE_MULTIPLE * _last_level_cache_bytes(), _MAX_COLD_BYTES)
        count = min(-(-needed // (self.weight.numel() * self.weight.element_size())), _MAX_COLD_COPIES)
        return [self.weight] + [self.weight.clone() for _ in range(count - 1)]

    @functools.cached_property
    def packed_copies(self) -> list[torch.Tensor]:
        return [_pack(copy_of_weight) for copy_of_weight in self.copies]

    def cycle(self, packed: bool = False) -> Iterator[torch.Tensor]:
        return itertools.cycle(self.packed_copies if packed else self.copies)


@functools.cache
def _last_level_cache_bytes() -> int:
    """The largest CPU cache's size in bytes, from Linux's sysfs, else `_DEFAULT_CACHE_BYTES`."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(path) as file:
                text = file.read().strip().upper()
            sizes.append(int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text))
        except (OSError, ValueError):
            continue
    return max(sizes, default=_DEFAULT_CACHE_BYTES)


def step_clock() -> float:
    """`time.perf_counter()` less the time `skinny_linear` spent measuring its kernels and packing weights: the
    decoding loop times its steps with it, so that a first use of a row count does not make that step look slow to
    the draft-length policy."""
    return time.perf_counter() - _measuring_seconds


class skinny_linears:
    """Context manager: the plain `nn.Linear` layers of `models` compute through `skinny_linear` inside the block.

    `dflash_decoding` uses it around its loop (on by default; `drafter.fast_cpu_linears = False` turns it off); use it
    around any other CPU generation to give it the same kernels, e.g. `with skinny_linears(target): target.generate(...)`.
    Only exact `nn.Linear` instances are touched: subclasses (quantized or LoRA layers) and modules whose `forward`
    is already replaced on the instance (accelerate's device hooks, another active `skinny_linears`) keep theirs.
    The original `forward` is restored on exit, also after an error.

    `rows`: the row counts the block will mostly run (e.g. verification widths x batch), or None. Given, the choice
    for each of them is measured on entry, and a layer whose weight is fastest with `F.linear` for all of them is left
    as it is: the detour through `skinny_linear` costs a few microseconds per call (measured: 6.6 us on a 2-core
    Xeon, 2.5 % of a SmolLM2 step over its 211 layers), for nothing where `F.linear` would be chosen anyway.
    """

    def __init__(self, *models: nn.Module, rows: Iterable[int] | None = None):
        self.models, self.rows = models, None if rows is None else sorted(set(rows))
        self.patched: list[nn.Linear] = []

    def __enter__(self):
        pays: dict[tuple, bool] = {}  # per weight shape, dtype and device
        for model in self.models:
            for module in model.modules():
                if type(module) is not nn.Linear or "forward" in module.__dict__ or hasattr(module, "_hf_hook"):
                    continue
                if self.rows is not None:
                    weight = module.weight
                    key = (weight.shape, weight.dtype, weight.device)
                    if key not in pays:
                        cold = ColdCopies(weight)  # its copies are made once, if a row count is measured
                        kernels = [kernel_for(weight, rows, cold=cold) for rows in self.rows]  # measures them all
                        pays[key] = any(kernel != "linear" for kernel in kernels)
                    if not pays[key]:
                        continue
                module.forward = functools.partial(_skinny_linear_forward, module)
                self.patched.append(module)
        return self

    def __exit__(self, *exc):
        for module in self.patched:
            module.__dict__.pop("forward", None)
        self.patched = []


def _skinny_linear_forward(module: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    return skinny_linear(input, module.weight, module.bias)


# The name under which `packed_gqa_sdpa` is registered in transformers' attention functions.
_PACKED_GQA_SDPA = "dflash_packed_gqa_sdpa"


def packed_gqa_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' "sdpa" attention without its copy of the keys/values for each query head of a group.

    With a mask and several query tokens, transformers repeats every cached key/value head for each query head of its
    group (`repeat_kv`) before calling SDPA, a copy of the whole cache per forward that dominates a batched
    verification on CPUs. Here the queries of a group are stacked instead, `[batch, kv_heads, groups * queries,
    head_dim]`, with the mask tiled to match: each query meets the same keys under the same mask, so the result is the
    same attention (float rounding aside). Anything else goes to transformers' function unchanged.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, num_queries, head_dim = query.shape
    groups = heads // key.shape[1]
    if (
        groups == 1
        or attention_mask is None
        or not 1 <= num_queries <= 64  # verification widths; a long prefill keeps the stock path
        or attention_mask.dim() != 4
        or attention_mask.shape[1] != 1  # one mask for all heads
        or (dropout and module.training)
        or any(kwargs.get(name) is not None for name in ("softcap", "position_bias", "s_aux", "sinks"))
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    packed = query.reshape(batch, key.shape[1], groups * num_queries, head_dim)  # head h = kv_head * groups + g
    mask = attention_mask[..., : key.shape[2]].expand(batch, 1, num_queries, key.shape[2]).repeat(1, 1, groups, 1)
    output = F.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scaling)
    return output.reshape(batch, heads, num_queries, head_dim).transpose(1, 2).contiguous(), None


class packed_gqa_attention:
    """Context manager: attention modules of `models` that run transformers' "sdpa" use `packed_gqa_sdpa` inside.

    `dflash_decoding` uses it on CPUs (with the linear kernels: `drafter.fast_cpu_linears`). Each such module gets a
    shallow copy of its config naming the packed function; the model's own config, and so its mask creation, stay
    "sdpa". The original configs are restored on exit, also after an error.
    """

    def __init__(self, *models: nn.Module):
        self.models = models
        self.patched: list[tuple[nn.Module, object]] = []

    def __enter__(self):
        from transformers import AttentionInterface

        AttentionInterface.register(_PACKED_GQA_SDPA, packed_gqa_sdpa)
        for model in self.models:
            for module in model.modules():
                config = module.__dict__.get("config")
                if hasattr(module, "num_key_value_groups") and getattr(config, "_attn_implementation", None) == "sdpa":
                    packed = copy.copy(config)
                    packed._attn_implementation_internal = _PACKED_GQA_SDPA
                    module.config = packed
                    self.patched.append((module, config))
        return self

    def __exit__(self, *exc):
        for module, config in self.patched:
            module.config = config
        self.patched = []


@contextlib.contextmanager
def cpu_kernels(*models: nn.Module, rows: Iterable[int] | None = None):
    """Context manager: both CPU kernels DFlash decoding runs with (`skinny_linears`, `packed_gqa_attention`). Use it
    around any other CPU generation to compare like with like, e.g. `with cpu_kernels(target): target.generate(...)`.
    `rows`: see `skinny_linears`."""
    with skinny_linears(*models, rows=rows), packed_gqa_attention(*models):
        yield
