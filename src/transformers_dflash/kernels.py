"""CPU kernels for the few-row products of speculative decoding (part of the carried core: torch and transformers only).

A verification forward multiplies every weight matrix by a handful of rows (block width x batch) and, at batch > 1,
attends with a mask. On CPUs both hit slow paths of the stock kernels; the two context managers here route them to
faster formulations of the same arithmetic. Neither is DFlash-specific: `with cpu_kernels(model): model.generate(...)`
gives plain decoding the same kernels. Measurements: docs/benchmarks.md ("Linear kernels", "Batched").
"""

import contextlib
import copy
import functools

import torch
from torch import nn
from torch.nn import functional as F

# Row counts for which `skinny_linear` takes the transposed product (measured faster, see `skinny_linear`).
_SKINNY_ROWS = (1, 256)
# One row takes the transposed product only for weights with this many times more outputs than inputs (LM heads).
_TALL_WEIGHT = 8
# On one thread the transposed product wins for fewer rows: up to this many, or `_ONE_THREAD_TALL_ROWS` for a tall
# weight, and never for one row (docs/benchmarks.md, "Linear kernels on one thread").
_ONE_THREAD_ROWS = 4
_ONE_THREAD_TALL_ROWS = 8


def skinny_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(input, weight, bias)`, computed as `(weight @ input^T)^T` for a few float32 rows on a CPU.

    On CPUs, PyTorch runs `input @ weight^T` for 2..256 rows through an MKL GEMM that is much slower than streaming
    the weights once, which the transposed product does (`dflash bench --linear-kernels` measures both). One row
    takes the same product as two copies of itself only for a tall weight (an LM head: at least
    `_TALL_WEIGHT` times more outputs than inputs), where MKL's matrix-vector product is slower; for other shapes
    the copy, concatenation and transposes cost more than they save, so one row takes `F.linear`
    (docs/benchmarks.md, "Linear kernels by shape"). The output is made contiguous again: leaving it transposed in
    memory saved the copy but slowed the ops after it more. Same arithmetic, other summation order: results agree to
    float32 rounding, like any change of batch shape. Other devices, dtypes and row counts take `F.linear` unchanged.
    """
    rows = input.numel() // input.shape[-1] if input.dim() > 0 and input.shape[-1] else 0
    if (
        input.device.type != "cpu"
        or input.dtype != torch.float32
        or weight.dtype != torch.float32
        or not _takes_transposed_product(rows, weight)  # last: it reads torch's thread count
    ):
        return F.linear(input, weight, bias)
    flat = input.reshape(rows, input.shape[-1])
    if rows == 1:
        output = torch.mm(weight, torch.cat([flat, flat]).t())[:, :1].t()
    else:
        output = torch.mm(weight, flat.t()).t()
    if bias is not None:
        output = output + bias
    return output.contiguous().view(*input.shape[:-1], weight.shape[0])


def _takes_transposed_product(rows: int, weight: torch.Tensor) -> bool:
    """Whether `rows` rows times `weight` are measured faster as the transposed product, with torch's thread count.

    With several threads MKL's GEMM leaves most of the weight-streaming speed unused for 2..256 rows, and its
    matrix-vector product does not use the other threads for a tall weight. On one thread neither holds as far: the
    matrix-vector product is the faster one-row kernel for every shape, and the transposed product wins only up to
    a few rows (more for a tall weight)."""
    tall = weight.shape[0] >= _TALL_WEIGHT * weight.shape[1]
    if torch.get_num_threads() == 1:
        return 2 <= rows <= (_ONE_THREAD_TALL_ROWS if tall else _ONE_THREAD_ROWS)
    return (1 if tall else 2) <= rows <= _SKINNY_ROWS[1]


class skinny_linears:
    """Context manager: the plain `nn.Linear` layers of `models` compute through `skinny_linear` inside the block.

    `dflash_decoding` uses it around its loop (on by default; `drafter.fast_cpu_linears = False` turns it off); use it
    around any other CPU generation to give it the same kernels, e.g. `with skinny_linears(target): target.generate(...)`.
    Only exact `nn.Linear` instances are touched: subclasses (quantized or LoRA layers) and modules whose `forward`
    is already replaced on the instance (accelerate's device hooks, another active `skinny_linears`) keep theirs.
    The original `forward` is restored on exit, also after an error.
    """

    def __init__(self, *models: nn.Module):
        self.models = models
        self.patched: list[nn.Linear] = []

    def __enter__(self):
        for model in self.models:
            for module in model.modules():
                if type(module) is nn.Linear and "forward" not in module.__dict__ and not hasattr(module, "_hf_hook"):
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
def cpu_kernels(*models: nn.Module):
    """Context manager: both CPU kernels DFlash decoding runs with (`skinny_linears`, `packed_gqa_attention`). Use it
    around any other CPU generation to compare like with like, e.g. `with cpu_kernels(target): target.generate(...)`."""
    with skinny_linears(*models), packed_gqa_attention(*models):
        yield
