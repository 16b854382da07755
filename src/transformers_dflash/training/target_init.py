"""Start a new drafter from the target's last decoder layers instead of random weights (`dflash train
--init-from-target`).

A drafter's layers have the target's shape, and its output goes through the target's final norm and LM head, so the
target's top layers are the nearest thing to a trained drafter that exists before training: drafter layer i starts
as target layer `L - n + i` (n drafter layers of a target with L), the final norm as the target's, and the fused
context as the hidden state those layers read in the target (`fc` picks the deepest target feature, which by
DFlash's default spread is the output of layer `L - n - 1`; `hidden_norm` is the first copied layer's input norm).
Llama-style targets have no per-head q/k norms, which DFlash layers apply: they start as a constant equal to the
root-mean-square the target's own queries and keys have per head on `calibration_ids`, so attention logits start at
the target's scale. What this buys is measured in docs/training.md.
"""

import functools

import torch
from torch import nn

from ..configuration_dflash import text_config
from ..modeling_dflash import DFlashDraftModel, DFlashRMSNorm
from ..target_model import decoder_layers, remove_hooks


def _fail(target: nn.Module, what: str) -> ValueError:
    return ValueError(
        f"--init-from-target: {what}, so {type(target).__name__}'s layers cannot seed the drafter (it works for "
        "Llama / Qwen2 / Qwen3 / Mistral-style decoder layers of the drafter's shape). Train from random weights "
        "(leave --init-from-target out)."
    )


def _check_plain_rms_norm(target: nn.Module, norm: nn.Module, eps: float, name: str) -> None:
    """Refuse norms that are not `x / rms(x) * weight` (Gemma's `1 + weight`, LayerNorm with a bias, ...): copying
    their weight into a DFlash RMSNorm would silently change what they compute."""
    weight = getattr(norm, "weight", None)
    if weight is None or weight.dim() != 1:
        raise _fail(target, f"its {name} has no 1-D weight")
    x = torch.randn(4, weight.shape[0], generator=torch.Generator().manual_seed(0)).to(weight)
    ours = DFlashRMSNorm(weight.shape[0], eps=eps).to(weight)
    ours.weight.data.copy_(weight.data)
    with torch.no_grad():
        if not torch.allclose(norm(x), ours(x), rtol=1e-3, atol=1e-4):
            raise _fail(target, f"its {name} ({type(norm).__name__}) is not a plain RMSNorm")


@torch.no_grad()
def _head_rms(projection: nn.Linear, norm: nn.Module, hidden: torch.Tensor, head_dim: int) -> float:
    """Mean over tokens and heads of the root-mean-square of `projection(norm(hidden))` per head."""
    out = projection(norm(hidden)).float()
    return out.view(*out.shape[:-1], -1, head_dim).pow(2).mean(-1).sqrt().mean().item()


@torch.no_grad()
def _layer_inputs(decoder: nn.Module, layers: nn.ModuleList, indices: list[int], input_ids: torch.Tensor) -> dict:
    """{i: the hidden states decoder layer i reads} for `indices`, from one forward of `decoder` on `input_ids`
    (forward pre-hooks keep just these, where `output_hidden_states=True` would keep every layer's)."""
    inputs = {}

    def keep(index, module, args, kwargs):
        inputs[index] = args[0] if args else kwargs["hidden_states"]

    handles = [layers[i].register_forward_pre_hook(functools.partial(keep, i), with_kwargs=True) for i in indices]
    try:
        decoder(input_ids=input_ids.to(next(decoder.parameters()).device), use_cache=False)
    finally:
        remove_hooks(handles)
    return inputs


@torch.no_grad()
def init_from_target_layers(drafter: DFlashDraftModel, target: nn.Module, calibration_ids: torch.Tensor) -> list[int]:
    """Copy the target's last `num_hidden_layers` decoder layers (and final norm) into the fresh `drafter`, in place;
    return the target layer indices copied. `calibration_ids` ([1, S] token ids): text to measure the target's query
    and key scale on, for targets without q/k norms. Raises a ValueError that says what does not fit."""
    config = drafter.config
    decoder, layers = decoder_layers(target)
    num_copied = config.num_hidden_layers
    if num_copied > len(layers):
        raise _fail(target, f"the drafter has {num_copied} layers and the target only {len(layers)}")
    sources = list(range(len(layers) - num_copied, len(layers)))
    eps = config.rms_norm_eps
    calibrated = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")  # when the target has none
    theirs_by_source = {source: layers[source].state_dict() for source in sources}
    # Check everything before changing anything, so that a refused target leaves the drafter as it was.
    for drafter_layer, source in zip(drafter.layers, sources):
        theirs = theirs_by_source[source]
        for name, param in drafter_layer.state_dict().items():
            if name in calibrated and name not in theirs:
                continue
            if name not in theirs or theirs[name].shape != param.shape:
                found = "missing" if name not in theirs else f"shaped {tuple(theirs[name].shape)}"
                raise _fail(target, f"its layer {source} has no `{name}` of shape {tuple(param.shape)} ({found})")
        for norm_name in ("input_layernorm", "post_attention_layernorm"):
            _check_plain_rms_norm(target, getattr(layers[source], norm_name), eps, f"layer {source}'s {norm_name}")
    final_norm = getattr(decoder, "norm", None)
    if final_norm is None:
        raise _fail(target, "its decoder has no final `norm`")
    _check_plain_rms_norm(target, final_norm, eps, "final norm")

    uncalibrated = [source for source in sources if calibrated[0] not in theirs_by_source[source]]
    layer_inputs = _layer_inputs(decoder, layers, uncalibrated, calibration_ids) if uncalibrated else {}
    for drafter_layer, source in zip(drafter.layers, sources):
        theirs = theirs_by_source[source]
        for name, param in drafter_layer.state_dict().items():
            if name in theirs:
                param.copy_(theirs[name])
        if source not in layer_inputs:
            continue
        attention, hidden = layers[source].self_attn, layer_inputs[source]
        norm = layers[source].input_layernorm
        drafter_layer.self_attn.q_norm.weight.fill_(_head_rms(attention.q_proj, norm, hidden, config.head_dim))
        drafter_layer.self_attn.k_norm.weight.fill_(_head_rms(attention.k_proj, norm, hidden, config.head_dim))

    drafter.norm.weight.copy_(final_norm.weight)
    drafter.hidden_norm.weight.copy_(layers[sources[0]].input_layernorm.weight)
    # fc: the identity on the deepest target feature, zero on the others (training spreads it from there).
    hidden_size = text_config(target.config).hidden_size
    deepest = max(range(len(config.target_layer_ids)), key=lambda i: config.target_layer_ids[i])
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, deepest * hidden_size : (deepest + 1) * hidden_size] = torch.eye(hidden_size)
    return sources
