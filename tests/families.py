"""Tiny random targets of every decoder family the matrix covers (tests/test_target_families.py, tests/test_hybrid.py).

Each family is a transformers `model_type` plus the few settings that make a 4-layer, hidden-32 model of it exercise
what matters: sliding windows crossed by the prompt + generation, MoE routing, linear-attention layers between full
ones. Hybrid families (recurrent state) are marked; Qwen3.5 exists only in transformers >= 5.
"""

import torch
import transformers
from conftest import BOS, PAD, VOCAB
from transformers import AutoConfig, AutoModelForCausalLM

MAJOR = int(transformers.__version__.split(".")[0])

# The shape every tiny target here shares (4 layers, hidden 32, 4 query / 2 KV heads of 8).
TINY_DECODER = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=512,
)
_LINEAR = dict(
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
_MAMBA = dict(
    mamba_n_heads=4,
    mamba_d_head=16,
    mamba_n_groups=1,
    mamba_d_state=8,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=16,
)

# name: (model_type, settings, hybrid, transformers major versions that have it)
FAMILIES = {
    "llama": ("llama", {}, False, (4, 5)),
    "qwen2": ("qwen2", {}, False, (4, 5)),
    "qwen3": ("qwen3", {}, False, (4, 5)),
    "qwen3_moe": ("qwen3_moe", dict(_MOE, decoder_sparse_step=1, mlp_only_layers=[]), False, (4, 5)),
    "mistral": ("mistral", {"sliding_window": 8}, False, (4, 5)),
    # Tied embeddings make these tiny random models repeat one token; untied they do not.
    "gemma2": ("gemma2", {"sliding_window": 8, "tie_word_embeddings": False}, False, (4, 5)),
    "gemma3": (
        "gemma3_text",
        {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"] * 2, "tie_word_embeddings": False},
        False,
        (4, 5),
    ),
    "phi3": ("phi3", {}, False, (4, 5)),
    "gpt_oss": (
        "gpt_oss",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "_scale": 2.0,
        },
        False,
        (4, 5),
    ),
    "qwen3_5": ("qwen3_5_text", _LINEAR, True, (5,)),
    "qwen3_5_moe": ("qwen3_5_moe_text", dict(_LINEAR, **_MOE, shared_expert_intermediate_size=16), True, (5,)),
    "qwen3_next": (
        "qwen3_next",
        dict(_LINEAR, **_MOE, shared_expert_intermediate_size=16, decoder_sparse_step=1),
        True,
        (4, 5),
    ),
    "lfm2": (
        "lfm2",
        {
            "layer_types": ["conv", "full_attention", "conv", "full_attention"],
            "conv_L_cache": 3,
            "block_ff_dim": 64,
            "block_auto_adjust_ff_dim": False,
            "tie_word_embeddings": False,
        },
        True,
        (4, 5),
    ),
    "granitemoehybrid": (
        "granitemoehybrid",
        dict(
            _MAMBA,
            layer_types=["mamba", "attention", "mamba", "attention"],
            num_local_experts=0,
            shared_intermediate_size=64,
        ),
        True,
        (4, 5),
    ),
    "falcon_h1": ("falcon_h1", dict(_MAMBA, mamba_d_ssm=64, projectors_bias=False, _scale=1.0), True, (4, 5)),
}
HYBRID = [name for name, spec in FAMILIES.items() if spec[2]]


def available(name: str) -> bool:
    return MAJOR in FAMILIES[name][3]


def make_family_target(name, dtype=torch.float64, seed=0, eos_token_id=None, vocab_size=VOCAB, scale=None, **overrides):
    """A tiny random target of family `name` (weights scaled up so its choices are peaked, as in conftest; by 5 unless
    the family says otherwise, chosen so that its greedy output is not one repeated token)."""
    model_type, family_settings, _, _ = FAMILIES[name]
    family_settings = dict(family_settings)
    family_scale = family_settings.pop("_scale", 5.0)
    scale = family_scale if scale is None else scale
    settings = dict(
        vocab_size=vocab_size,
        **TINY_DECODER,
        bos_token_id=BOS,
        eos_token_id=eos_token_id,
        pad_token_id=PAD,
    )
    config = AutoConfig.for_model(model_type, **{**settings, **family_settings, **overrides})
    kwargs = {"dtype": dtype}
    if MAJOR >= 5:
        kwargs["experts_implementation"] = "eager"  # the grouped-mm experts take no float64
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", **kwargs)
    except ValueError:  # families without an SDPA path (attention sinks, soft-capping)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", **kwargs)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(scale)
    return model.eval()


def left_pad(prompts, width=None):
    """The prompts left-padded with PAD to the longest of them (or to `width`, if longer), and their attention mask."""
    width = max(width or 0, *(len(p) for p in prompts))
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = p
        mask[i, width - len(p) :] = 1
    return ids, mask
