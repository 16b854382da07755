"""Configuration of a DFlash block-diffusion drafter.

This file is copied next to every checkpoint by `save_pretrained`, so it imports only torch and transformers.

A DFlash drafter is a small stack of Qwen3-style decoder layers that has no embedding table and no LM head of its
own: it borrows both from the target model. Besides the usual decoder hyper-parameters the config carries the three
DFlash-specific settings:

- `block_size`: tokens per draft block (the anchor plus `block_size - 1` masked slots filled in one forward);
- `mask_token_id`: the embedding row used for the masked slots;
- `target_layer_ids`: which target layers feed the drafter (hidden state `layer_id + 1`, index 0 = embeddings).

Two on-disk layouts are read:

- ours: `model_type: "dflash"` with the DFlash settings at the top level and in `dflash_config`;
- the released DFlash checkpoints: `model_type: "qwen3"`, `mask_token_id`/`target_layer_ids` (and, for newer
  checkpoints, `block_size`) inside `dflash_config`, `block_size` otherwise at the top level.
"""

from transformers import PretrainedConfig


def text_config(config):
    """The language-model part of a config (multimodal models nest it; plain LMs return themselves)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def default_target_layer_ids(num_target_layers: int, num_features: int = 5) -> list[int]:
    """The DFlash default: `round(1 + i * (L - 4) / (K - 1))` for `i` in `0..K-1` (`K == 1`: `[L // 2]`).

    36-layer Qwen3 -> [1, 9, 17, 25, 33]; 32-layer Llama -> [1, 8, 15, 22, 29]. Targets too shallow for that formula
    get up to K distinct layers spread over all but the last one (whose transformers hidden state is the final-normed
    output, which serving engines cannot capture).
    """
    if num_target_layers <= 2:
        return [0]
    if num_features <= 1:
        return [num_target_layers // 2]
    ids = [round(1 + i * (num_target_layers - 4) / (num_features - 1)) for i in range(num_features)]
    if len(set(ids)) == num_features and all(0 <= i < num_target_layers - 1 for i in ids):
        return ids
    num_features = min(num_features, num_target_layers - 1)
    step = (num_target_layers - 2) / (num_features - 1)
    return sorted({round(i * step) for i in range(num_features)})


def _normalized_rope(params: dict | None, rope_theta: float) -> dict:
    """`{"rope_type", "rope_theta", ...scaling keys}` from a 4.x `rope_scaling` or a 5.x `rope_parameters` dict."""
    params = dict(params or {})
    params["rope_type"] = params.get("rope_type", params.pop("type", "default")) or "default"
    params.pop("type", None)
    params.setdefault("rope_theta", rope_theta)
    return params


# RoPE keys of a target that a drafter does not inherit: it rotates its whole head (like the released drafters, whose
# config is a plain Qwen3 one), with one set of frequencies for every position (no multimodal sections).
TARGET_ONLY_ROPE_KEYS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")

# MLP width of a drafter built for a target whose config has no dense `intermediate_size` (MoE-only configs such as
# Qwen3.5-MoE): this many times its hidden size, the ratio of the released Qwen3 drafters (12288 for hidden 4096).
DEFAULT_MLP_RATIO = 3


def rope_parameters_from_config(config) -> dict:
    """RoPE settings of any transformers text config, as one dict `{"rope_type", "rope_theta", ...}`.

    transformers 4.x keeps `rope_theta` and `rope_scaling` as two attributes; 5.x folds both into `rope_parameters`,
    nested per layer type for targets whose sliding and full layers differ (Gemma 3): the full layers' settings
    are taken then.
    """
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict):
        params = getattr(config, "rope_scaling", None)
    if isinstance(params, dict) and params and all(isinstance(v, dict) or v is None for v in params.values()):
        params = params.get("full_attention") or next(v for v in params.values() if v)
    return _normalized_rope(params, getattr(config, "rope_theta", None) or 10000.0)


def decoder_shape_kwargs(config) -> dict:
    """The decoder-layer shape of a transformers text config, as `DFlashConfig` keyword arguments: hidden and MLP
    sizes, attention heads (GQA, head_dim defaulting to hidden_size // heads), activation, RMSNorm epsilon, context
    length and RoPE. Used to build a drafter that fits a target, and to read a foreign decoder config.

    An MoE config without a dense `intermediate_size` gives `DEFAULT_MLP_RATIO * hidden_size` (pass
    `intermediate_size=` to `from_target` to choose another). The RoPE type and scaling are kept; the keys in
    `TARGET_ONLY_ROPE_KEYS` are dropped."""
    heads = config.num_attention_heads
    rope = {k: v for k, v in rope_parameters_from_config(config).items() if k not in TARGET_ONLY_ROPE_KEYS}
    if rope.get("rope_type") in ("yarn", "longrope", "llama3"):
        rope.setdefault(
            "original_max_position_embeddings",
            getattr(config, "original_max_position_embeddings", None) or config.max_position_embeddings,
        )
    return dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=getattr(config, "intermediate_size", None) or DEFAULT_MLP_RATIO * config.hidden_size,
        num_attention_heads=heads,
        num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        hidden_act=getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None) or "silu",
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=getattr(config, "rms_norm_eps", 1e-6),
        rope_parameters=rope,
        bos_token_id=getattr(config, "bos_token_id", None),
        eos_token_id=getattr(config, "eos_token_id", None),
        pad_token_id=getattr(config, "pad_token_id", None),
    )


class DFlashConfig(PretrainedConfig):
    r"""Configuration of a [`DFlashDraftModel`].

    Args:
        vocab_size (`int`): rows of the TARGET's embedding table (the drafter borrows it; it stores no copy).
        hidden_size (`int`): must equal the target's hidden size.
        intermediate_size (`int`): SwiGLU MLP width.
        num_hidden_layers (`int`): drafter depth (the released Qwen3-8B drafter has 5).
        num_attention_heads / num_key_value_heads / head_dim: GQA attention shape.
        hidden_act (`str`): MLP activation, `"silu"` for SwiGLU.
        max_position_embeddings (`int`): longest context the drafter was built for; longer prompts are refused.
        rms_norm_eps (`float`): RMSNorm epsilon.
        rope_theta (`float`), rope_scaling (`dict`, optional), rope_parameters (`dict`, optional): RoPE settings in
            either the 4.x or the 5.x spelling; stored as `rope_parameters`.
        attention_bias (`bool`): biases in q/k/v/o projections.
        layer_types (`list[str]`): `"full_attention"` or `"sliding_attention"` per layer.
        sliding_window (`int`, optional): window of the sliding layers.
        block_size (`int`): tokens per draft block, anchor included (16 for the released Qwen3 drafters).
        mask_token_id (`int`): embedding row of the masked slots.
        target_layer_ids (`list[int]`): target layers whose outputs feed the drafter.
        num_target_layers (`int`, optional): depth of the target the drafter was trained for.
        draft_vocab_size (`int`, optional): the drafter proposes only from this many target tokens (a reduced draft
            vocabulary, as in EAGLE-3); their ids are the drafter's `draft_vocab_ids` buffer. `None`: the whole
            vocabulary. Verification still uses the target's full vocabulary, so outputs do not change.
        bos_token_id / eos_token_id / pad_token_id: the target's (the drafter shares its tokenizer).
    """

    model_type = "dflash"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 151936,
        hidden_size: int = 4096,
        intermediate_size: int = 12288,
        num_hidden_layers: int = 5,
        num_attention_heads: int = 32,
        num_key_value_heads: int = 8,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        max_position_embeddings: int = 40960,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        rope_theta: float | None = None,
        attention_bias: bool = False,
        attention_dropout: float = 0.0,
        layer_types: list[str] | None = None,
        sliding_window: int | None = None,
        use_sliding_window: bool = False,
        max_window_layers: int | None = None,
        block_size: int | None = None,
        mask_token_id: int | None = None,
        target_layer_ids: list[int] | None = None,
        num_target_layers: int | None = None,
        draft_vocab_size: int | None = None,
        dflash_config: dict | None = None,
        tie_word_embeddings: bool = False,
        bos_token_id: int | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        **kwargs,
    ):
        # RoPE: accept the 4.x spelling (`rope_theta` + `rope_scaling`) and the 5.x one (`rope_parameters`). We pop
        # them before `super().__init__` so transformers' own RoPE standardisation never sees a half-filled config.
        rope_scaling = kwargs.pop("rope_scaling", None)
        rope_parameters = kwargs.pop("rope_parameters", None)
        params = _normalized_rope(rope_parameters or rope_scaling, rope_theta if rope_theta is not None else 1e6)
        self.rope_parameters = params
        self.rope_theta = params["rope_theta"]

        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        self.layer_types = list(layer_types) if layer_types is not None else ["full_attention"] * num_hidden_layers
        self.sliding_window = sliding_window
        self.use_sliding_window = use_sliding_window
        self.max_window_layers = max_window_layers if max_window_layers is not None else num_hidden_layers

        # DFlash settings: the top level wins over `dflash_config` for block_size (released Qwen3 layout), while
        # mask_token_id / target_layer_ids live in `dflash_config` in the released layout.
        dflash_config = dict(dflash_config or {})
        if block_size is None:
            block_size = dflash_config.get("block_size", 16)
        if mask_token_id is None:
            mask_token_id = dflash_config.get("mask_token_id")
        if target_layer_ids is None:
            target_layer_ids = dflash_config.get("target_layer_ids")
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(num_target_layers or 36)
        self.block_size = int(block_size)
        self.mask_token_id = mask_token_id if mask_token_id is None else int(mask_token_id)
        self.target_layer_ids = [int(i) for i in target_layer_ids]
        self.num_target_layers = num_target_layers
        self.draft_vocab_size = None if draft_vocab_size is None else int(draft_vocab_size)
        self.dflash_config = {
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": self.target_layer_ids,
        }
        self._validate_dflash()  # before transformers' own checks, so the messages say how to fix a DFlash config
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        # The target's special tokens, set after transformers' own __init__ (4.x sets them to None there, 5.x has no
        # such attributes unless a config declares them): pipeline(..., assistant_model=drafter) compares them with
        # the target's to decide that the two share a tokenizer.
        self.bos_token_id, self.eos_token_id, self.pad_token_id = bos_token_id, eos_token_id, pad_token_id

    def _validate_dflash(self):
        if self.num_hidden_layers < 1:
            raise ValueError(f"num_hidden_layers must be at least 1 (a drafter layer), got {self.num_hidden_layers}.")
        if self.block_size < 2:
            raise ValueError(f"block_size must be at least 2 (an anchor plus one masked slot), got {self.block_size}.")
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size must be between 1 and vocab_size ({self.vocab_size}), got {self.draft_vocab_size}; "
                "use None for the full vocabulary."
            )
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one target layer.")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}; "
                "give one entry ('full_attention' or 'sliding_attention') per drafter layer."
            )
        unknown = set(self.layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(f"Unknown layer_types {sorted(unknown)}: use 'full_attention' or 'sliding_attention'.")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("layer_types has 'sliding_attention' layers but sliding_window is not set.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})."
            )
        if self.num_target_layers is not None:
            bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
            if bad:
                raise ValueError(
                    f"target_layer_ids {bad} are out of range for a target with {self.num_target_layers} layers "
                    f"(valid ids are 0..{self.num_target_layers - 1})."
                )
