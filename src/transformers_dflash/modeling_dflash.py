"""The DFlash block-diffusion drafter (arXiv 2602.06036).

Part of the carried core (`code_files.py`): it imports only torch, transformers and its sibling core files, and never
the decoding loop, which depends on it. `dflash.py` (the entry point) installs the generation hook.

How the drafter works, in one paragraph: at each decoding step it receives the last token the target produced (the
"anchor") followed by `block_size - 1` mask tokens, embedded by the TARGET's embedding table, and fills all masks in
ONE non-causal forward. It is conditioned on the target's own hidden states: features from `target_layer_ids` are
concatenated, projected by `fc` and normalised by `hidden_norm` into one `context_features` row per verified
position, and those rows are injected as extra keys and values into EVERY drafter layer ("KV injection"). The
context rows get no input LayerNorm and never pass through `o_proj` or the MLP. RoPE uses absolute positions: context
rows at their true positions, block rows at `start .. start + block_size - 1`. The target's `lm_head` turns the
drafter's outputs into draft logits.
"""

from collections.abc import Callable

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN
from transformers.modeling_outputs import BaseModelOutput

try:  # transformers >= 4.48
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
except ImportError:  # pragma: no cover - older releases are outside the supported range
    ALL_ATTENTION_FUNCTIONS = {}

from .code_files import write_code_files
from .configuration_dflash import DFlashConfig, decoder_shape_kwargs, default_target_layer_ids
from .target_model import text_config


class DFlashRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class _RopeSettings:
    """The attributes transformers' RoPE initialisers read from a config, for the drafter's head.

    transformers 4.57 reads `rope_theta` and `rope_scaling`; 5.x reads `rope_parameters` (after
    `standardize_rope_params`, a no-op here: the dict is complete). The drafter rotates its whole head."""

    def __init__(self, config: DFlashConfig):
        params = dict(config.rope_parameters)
        params.setdefault("rope_type", "default")
        self.rope_parameters = self.rope_scaling = params
        self.rope_theta = params["rope_theta"]
        self.head_dim = config.head_dim
        self.hidden_size = config.hidden_size
        self.num_attention_heads = config.num_attention_heads
        self.max_position_embeddings = config.max_position_embeddings
        self.partial_rotary_factor = 1.0

    def standardize_rope_params(self):
        pass


def _rope_inverse_frequencies(config: DFlashConfig) -> torch.Tensor:
    """The drafter's RoPE inverse frequencies, float32 (see `_rope_init`)."""
    return _rope_init(config)[0]


def _rope_init(config: DFlashConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32) and cos/sin scale of the drafter's RoPE, from transformers' own initialisers
    (`transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`), so every RoPE type a target can have works: default,
    linear, llama3, yarn (gpt-oss), longrope, dynamic (at its initial frequencies: the drafter does not re-scale
    them with the sequence length)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    settings = _RopeSettings(config)
    rope_type = settings.rope_parameters["rope_type"]
    dim = config.head_dim
    if rope_type == "default":
        inv_freq = 1.0 / (settings.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv_freq, 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(
            f"rope_type={rope_type!r} is not one of transformers' RoPE types ({sorted(ROPE_INIT_FUNCTIONS)}). Set "
            "rope_parameters in the drafter's config.json to one of those."
        )
    try:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](settings, torch.device("cpu"))
    except (KeyError, TypeError) as error:
        raise ValueError(
            f"The drafter's rope_parameters {settings.rope_parameters} lack a setting that rope_type={rope_type!r} "
            f"needs ({error!r}); copy them from the target's config."
        ) from error
    return inv_freq.float(), float(scaling)


class DFlashRotaryEmbedding(nn.Module):
    """RoPE cos/sin for absolute positions.

    The inverse frequencies are computed from the config in float32 and kept per device OUTSIDE the module's
    buffers: a buffer would be rounded by `drafter.to(torch.bfloat16)` (angles drift by radians at long positions) and
    is left uninitialised by transformers 5's meta-device loading. RoPE types with an attention scale (yarn) scale
    cos and sin by it, as transformers' rotary embeddings do.
    """

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        inv_freq, self.attention_scaling = _rope_init(config)  # also validates the RoPE settings
        self._inv_freq: dict[torch.device, torch.Tensor] = {inv_freq.device: inv_freq}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq:
            self._inv_freq[device] = _rope_inverse_frequencies(self.config).to(device)
        return self._inv_freq[device]

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(x.dtype), sin.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` of shape [batch, heads, seq, head_dim] by `cos`/`sin` of shape [batch, seq, head_dim]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
):
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            attn_weights = attn_weights.masked_fill(~attention_mask, torch.finfo(attn_weights.dtype).min)
        else:
            attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous(), attn_weights


class DFlashDrafterCache:
    """The drafter's context cache: per-layer keys/values of the projected context rows, and their positions.

    Only VERIFIED positions ever enter it, so it never needs cropping. Buffers grow by doubling. Each drafter forward
    writes the new context rows at `context_length` and the block's own keys/values right after them, attends over
    the view `[:context_length + new + block]`, then `advance` moves `context_length` past the new context rows only:
    the block is overwritten by the next step's context (no concatenation, no copy of the growing context).
    """

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.positions: torch.Tensor | None = None
        self.context_length = 0

    @staticmethod
    def _fit(buffer: torch.Tensor | None, like: torch.Tensor, dim: int, used: int, end: int) -> torch.Tensor:
        """`buffer` if it holds `end` entries along `dim`, else a larger copy of its first `used` entries."""
        if buffer is not None and buffer.shape[dim] >= end and buffer.shape[0] == like.shape[0]:
            return buffer
        shape = list(like.shape)
        shape[dim] = max(end, 2 * (buffer.shape[dim] if buffer is not None else 0), 256)
        grown = like.new_empty(shape)
        if buffer is not None and used > 0:
            grown.narrow(dim, 0, used).copy_(buffer.narrow(dim, 0, used))
        return grown

    def update(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """Write [new context ; block] keys/values ([batch, kv_heads, seq, head_dim]); return the views to attend."""
        start, end = self.context_length, self.context_length + key_states.shape[2]
        self.keys[layer_idx] = self._fit(self.keys[layer_idx], key_states, 2, start, end)
        self.values[layer_idx] = self._fit(self.values[layer_idx], value_states, 2, start, end)
        self.keys[layer_idx][:, :, start:end] = key_states
        self.values[layer_idx][:, :, start:end] = value_states
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    def past_positions(self) -> torch.Tensor | None:
        return None if self.positions is None else self.positions[:, : self.context_length]

    def advance(self, context_position_ids: torch.LongTensor):
        """Commit the new context rows (their positions are `context_position_ids`, [batch, new])."""
        start, end = self.context_length, self.context_length + context_position_ids.shape[1]
        self.positions = self._fit(self.positions, context_position_ids, 1, start, end)
        self.positions[:, start:end] = context_position_ids
        self.context_length = end

    def batch_select_indices(self, indices: torch.Tensor):
        """Keep only the rows `indices` of the batch (finished sequences leave the batch)."""
        self.keys = [k[indices] if k is not None else None for k in self.keys]
        self.values = [v[indices] if v is not None else None for v in self.values]
        self.positions = self.positions[indices] if self.positions is not None else None


class DFlashAttention(nn.Module):
    """GQA attention whose keys/values are [context rows ; block rows] and whose queries are the block rows."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        # Non-causal: every block row sees every other block row (and the context). transformers' eager, SDPA and
        # FlashAttention-2 integrations all read this flag.
        self.is_causal = False
        self.sliding_window = config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None

        self.q_proj = nn.Linear(
            config.hidden_size, config.num_attention_heads * self.head_dim, bias=config.attention_bias
        )
        self.k_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias
        )
        self.v_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.attention_bias
        )
        self.q_norm = DFlashRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        context_features: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: DFlashDrafterCache | None = None,
    ) -> torch.Tensor:
        batch, block_len, _ = hidden_states.shape
        num_context = context_features.shape[1]
        # One projection for [context ; block]: the context rows are the fused target features (no input norm).
        kv_input = torch.cat([context_features, hidden_states], dim=1)
        query_states = self.q_norm(self.q_proj(hidden_states).view(batch, block_len, -1, self.head_dim)).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(kv_input).view(batch, num_context + block_len, -1, self.head_dim))
        key_states = key_states.transpose(1, 2)
        value_states = self.v_proj(kv_input).view(batch, num_context + block_len, -1, self.head_dim).transpose(1, 2)

        cos, sin = position_embeddings  # for [context ; block] positions
        query_states = apply_rotary_pos_emb(query_states, cos[:, num_context:], sin[:, num_context:])
        key_states = apply_rotary_pos_emb(key_states, cos, sin)
        if cache is not None:
            key_states, value_states = cache.update(self.layer_idx, key_states, value_states)

        attention_interface: Callable = eager_attention_forward
        if self.config._attn_implementation not in (None, "eager"):
            attention_interface = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
        attn_output, _ = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            is_causal=False,
        )
        return self.o_proj(attn_output.reshape(batch, block_len, -1).contiguous())


class DFlashMLP(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, context_features, position_embeddings, attention_mask=None, cache=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states, context_features, position_embeddings, attention_mask, cache)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states


# Where `DFlashDraftModel.from_released_model` caches its drafter on the foreign model (in `__dict__`).
_ADOPTED_DRAFTER = "_dflash_adopted_drafter"

# Run-time settings of `DFlashDraftModel` (not saved with a checkpoint), read by the decoding path.
RUN_TIME_SETTINGS = ("draft_length", "ngram_lookup", "fast_cpu_linears")


def _holds_parameters_of(drafter: nn.Module, module: nn.Module) -> bool:
    """Whether `drafter` still holds `module`'s current Parameter and buffer objects, name for name."""
    mine, theirs = drafter.state_dict(keep_vars=True), module.state_dict(keep_vars=True)
    return mine.keys() == theirs.keys() and all(mine[name] is theirs[name] for name in mine)


class DFlashPreTrainedModel(PreTrainedModel):
    config_class = DFlashConfig
    base_model_prefix = "dflash"
    supports_gradient_checkpointing = False
    _no_split_modules = ["DFlashDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flash_attn_2 = True
    _supports_flex_attn = False
    _supports_attention_backend = True
    main_input_name = "block_embeddings"

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, DFlashRMSNorm):
            nn.init.ones_(module.weight)


class DFlashDraftModel(DFlashPreTrainedModel):
    """The DFlash drafter. It owns no embedding and no LM head: both are borrowed from the target at run time.

    Use it as `target.generate(input_ids, assistant_model=drafter)`; after each call,
    `drafter.last_acceptance_lengths` lists the tokens gained per target forward of that call (see
    `DFlashCandidateGenerator`).
    """

    is_dflash_drafter = True  # lets tools recognise a drafter from any copy of this file (trust_remote_code or ours)

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        self.layers = nn.ModuleList([DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = DFlashRotaryEmbedding(config)
        if config.draft_vocab_size is not None:
            # Reduced draft vocabulary: the target token id of each row the drafter scores (saved with the weights).
            # Drafting then costs draft_vocab_size rows of the LM head instead of the whole vocabulary.
            self.register_buffer("draft_vocab_ids", torch.arange(config.draft_vocab_size), persistent=True)
        else:
            self.draft_vocab_ids = None
        self.last_acceptance_lengths: list[int] = []
        # How many drafts to verify per step: None (the device's fastest measured default), "full", a confidence
        # threshold or "auto" (see draft_length.py). A run-time setting, not saved with the checkpoint.
        self.draft_length: float | str | None = None
        # Verify (and draft) through `kernels.skinny_linear` on CPUs: for the few rows of a verification forward it
        # takes whichever product (F.linear, transposed, oneDNN-packed) was measured fastest on this machine. A
        # run-time setting, not saved.
        self.fast_cpu_linears: bool = True
        # Also copy drafts from the sequence itself when its last n tokens occurred before (ngram_lookup.py): None
        # (the device's default), 0 (off) or the longest n-gram to match. A run-time setting, not saved.
        self.ngram_lookup: int | None = None
        # What draft_length="auto" and the copied drafts measured in earlier generate() calls (step costs, copy
        # acceptance), per device, thread count and batch size; `.clear()` forgets it. Never saved.
        self.draft_length_memory: dict = {}
        self.model_tags = ["dflash", "speculative-decoding"]  # per instance: transformers appends to it in place
        self.post_init()

    def get_input_embeddings(self):
        return None  # borrowed from the target

    def draft_head(self, lm_head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Weight and bias of the target's `lm_head` restricted to the draft vocabulary (all rows without one).

        Row i of the result scores target token `draft_vocab_ids[i]`.
        """
        weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
        if self.draft_vocab_ids is None:
            return weight, bias
        ids = self.draft_vocab_ids.to(weight.device)
        return weight[ids], None if bias is None else bias[ids]

    def set_draft_vocabulary(self, token_ids) -> None:
        """Fill `draft_vocab_ids` with `token_ids` (distinct target ids, `config.draft_vocab_size` of them)."""
        if self.draft_vocab_ids is None:
            raise ValueError("This drafter drafts from the whole vocabulary; build it with draft_vocab_size set.")
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().sort().values
        if len(ids) != self.config.draft_vocab_size or len(ids.unique()) != len(ids):
            raise ValueError(
                f"Expected {self.config.draft_vocab_size} distinct token ids for the draft vocabulary, got {len(ids)} "
                f"({len(ids.unique())} distinct)."
            )
        if ids[0] < 0 or ids[-1] >= self.config.vocab_size:
            raise ValueError(f"Draft vocabulary ids must lie in 0..{self.config.vocab_size - 1}.")
        self.draft_vocab_ids.copy_(ids.to(self.draft_vocab_ids.device))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """`PreTrainedModel.from_pretrained`, made strict: a drafter with missing, unexpected or mis-shaped tensors
        would draft garbage silently, so those raise a ValueError that names them. Weights load from safetensors
        only (pickled `.bin` files can run code when loaded)."""
        config = kwargs.pop("config", None)
        if config is not None and not isinstance(config, DFlashConfig):
            # A released-layout folder (`model_type: "qwen3"`) loaded through AutoModel hands us the Qwen3Config it
            # read: read the same config.json as a DFlashConfig instead.
            config = None
        if config is not None:
            kwargs["config"] = config
        if kwargs.pop("use_safetensors", True) is False:
            raise ValueError("DFlash drafters load from safetensors only; pickled weights are refused.")
        wants_info = kwargs.pop("output_loading_info", False)
        try:
            model, info = super().from_pretrained(
                pretrained_model_name_or_path, *model_args, use_safetensors=True, output_loading_info=True, **kwargs
            )
        except RuntimeError as error:  # transformers reports shape mismatches as RuntimeError("size mismatch ...")
            if "mismatch" in str(error).lower():
                raise ValueError(
                    f"The checkpoint in {pretrained_model_name_or_path} has tensors whose shapes do not match its "
                    f"config.json; it is corrupt or its config belongs to another drafter. Details: {error}"
                ) from error
            raise
        except OSError as error:
            if "safetensors" in str(error) or ".bin" in str(error):
                raise ValueError(
                    f"No model.safetensors in {pretrained_model_name_or_path}: DFlash drafters load from safetensors "
                    "only (pickled .bin weights can run code). Convert the weights with safetensors.torch.save_file."
                ) from error
            raise
        except Exception as error:
            if type(error).__name__ != "SafetensorError":  # safetensors' own error type (not imported: core rule)
                raise
            raise ValueError(
                f"The weights file model.safetensors in {pretrained_model_name_or_path} cannot be read: it is "
                f"truncated or corrupt ({error}). Copy or download it again, or export the drafter again "
                "(`dflash export`, `drafter.save_pretrained`)."
            ) from None
        problems = {
            "missing": list(info.get("missing_keys", [])),
            "unexpected": list(info.get("unexpected_keys", [])),
            "mis-shaped": [str(m) for m in info.get("mismatched_keys", [])],
        }
        problems = {kind: keys for kind, keys in problems.items() if keys}
        if problems:
            details = "; ".join(f"{kind} tensors: {sorted(keys)[:8]}" for kind, keys in problems.items())
            raise ValueError(
                f"The checkpoint in {pretrained_model_name_or_path} does not match the DFlash drafter layout ({details}). "
                "A DFlash checkpoint stores layers.{i}.self_attn.{q,k,v,o}_proj, q_norm, k_norm, mlp.{gate,up,down}_proj, "
                "input/post_attention_layernorm, fc, hidden_norm and norm weights."
            )
        return (model, info) if wants_info else model

    @classmethod
    def from_released_model(cls, module: nn.Module) -> "DFlashDraftModel":
        """This class's drafter holding the very weights of `module`, a released DFlash drafter built by other code
        (z-lab's own `dflash.py`, loaded with `AutoModel.from_pretrained(path, trust_remote_code=True)`).

        Such a model has the released layout's modules (`layers`, `fc`, `hidden_norm`, `norm`) and a Qwen3 config
        with a `dflash_config`, but its own forward and `spec_generate`. The drafter returned here is built on the
        meta device and then takes `module`'s Parameter objects themselves (nothing is copied): it follows
        `module`'s dtype and device, also after `module.to(...)`. It is cached on `module` (outside its submodules and
        its state dict), so later calls return the same drafter until `module`'s parameters are replaced.

        `target.generate(input_ids, assistant_model=module)` calls this and decodes with the result. The run-time
        settings `draft_length`, `ngram_lookup` and `fast_cpu_linears` set on `module` are copied to the drafter on
        every call; the statistics (`last_acceptance_lengths`) live on the drafter, and `generate` also sets them on
        `module`.

        A model whose config carries a `dflash_config` but that lacks those modules (a released folder loaded
        without its code, as a plain `Qwen3Model`: fc and hidden_norm weights dropped, embeddings random) is refused
        with a ValueError that names the call to make instead, and so is one whose tensors do not match this layout.
        """
        if isinstance(module, cls):
            return module
        cached = module.__dict__.get(_ADOPTED_DRAFTER)
        if cached is None or not _holds_parameters_of(cached, module):
            cached = cls._adopt(module)
            module.__dict__[_ADOPTED_DRAFTER] = cached  # not a submodule: module's state dict stays the released one
        for name in RUN_TIME_SETTINGS:
            if name in module.__dict__:
                setattr(cached, name, module.__dict__[name])
        return cached

    @classmethod
    def _adopt(cls, module: nn.Module) -> "DFlashDraftModel":
        foreign = getattr(module, "config", None)
        if not isinstance(getattr(foreign, "dflash_config", None), dict):
            raise ValueError(
                f"{type(module).__name__} is not a DFlash drafter: its config has no dflash_config. Load a DFlash "
                "drafter with transformers_dflash.DFlashDraftModel.from_pretrained(path), or build one for a target "
                "with DFlashDraftModel.from_target(target)."
            )
        path = getattr(foreign, "_name_or_path", "") or "<the drafter's folder or Hub id>"
        missing = [
            name
            for name in ("layers", "fc", "hidden_norm", "norm")
            if not isinstance(getattr(module, name, None), nn.Module)
        ]
        if missing:
            randomised = sorted(
                {n.rsplit(".", 1)[-1] for n, _ in module.named_modules() if n.endswith(("embed_tokens", "lm_head"))}
            )
            also = (
                f", and its {' and '.join(randomised)} weights are random (a DFlash checkpoint stores none)"
                if randomised
                else ""
            )
            raise ValueError(
                f"This {type(module).__name__} is a DFlash drafter checkpoint ({path}; its config carries a "
                f"dflash_config) loaded without the DFlash code, as a plain transformers model: it has no "
                f"{' or '.join(missing)} module, so the checkpoint's fc and hidden_norm weights were dropped at loading"
                f"{also}. It cannot draft. Load the drafter with "
                f"transformers_dflash.DFlashDraftModel.from_pretrained({path!r}) instead (no code from the folder "
                f"runs), or convert the folder once with `dflash export --layout hub --out my-drafter {path}` and load "
                "that with AutoModel.from_pretrained('my-drafter', trust_remote_code=True)."
            )
        settings = {
            k: v for k, v in foreign.to_dict().items() if k not in ("model_type", "transformers_version", "auto_map")
        }
        config = DFlashConfig(**settings)
        attn = getattr(foreign, "_attn_implementation", None)
        config._attn_implementation = attn if attn in ("eager", "sdpa", "flash_attention_2") else "sdpa"
        state = module.state_dict(keep_vars=True)  # the Parameter objects themselves: assigned below, not copied
        if any(t.is_meta for t in state.values()):
            raise ValueError(
                f"Some of {type(module).__name__}'s weights are on the meta device (offloaded by a device_map): load "
                f"the drafter on one device, e.g. transformers_dflash.DFlashDraftModel.from_pretrained({path!r})."
            )
        with torch.device("meta"):
            drafter = cls(config)
        drafter.rotary_emb = DFlashRotaryEmbedding(config)  # holds no tensors of the checkpoint; frequencies off meta
        expected = set(drafter.state_dict())
        problems = {"missing": sorted(expected - set(state)), "unexpected": sorted(set(state) - expected)}
        problems = {kind: names for kind, names in problems.items() if names}
        if problems:
            details = "; ".join(f"{kind} tensors: {names[:8]}" for kind, names in problems.items())
            raise ValueError(
                f"{type(module).__name__} carries a dflash_config but its tensors do not match the DFlash drafter "
                f"layout ({details}). Load its folder with transformers_dflash.DFlashDraftModel.from_pretrained({path!r}), "
                "which reports what the checkpoint lacks."
            )
        try:
            drafter.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as error:  # size mismatches
            raise ValueError(
                f"{type(module).__name__}'s tensors do not have the shapes its config implies ({error}); its config "
                "belongs to another drafter."
            ) from error
        return drafter.train(module.training)

    def forward(
        self,
        block_embeddings: torch.Tensor,
        context_features: torch.Tensor,
        block_position_ids: torch.LongTensor,
        context_position_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        cache: DFlashDrafterCache | None = None,
        **kwargs,
    ) -> BaseModelOutput:
        r"""
        block_embeddings (`[batch, block_len, hidden]`): target embeddings of the block(s), anchor first.
        context_features (`[batch, num_context, len(target_layer_ids) * hidden]`): the target's hidden states at
            `target_layer_ids`, concatenated; with a `cache`, only the rows not yet in it.
        block_position_ids (`[batch, block_len]`), context_position_ids (`[batch, num_context]`): absolute positions.
        attention_mask (optional, `[batch, 1, block_len, kv_len]`, bool or additive): over keys
            [cached context ; new context ; block]. `None` means every block row sees every key (inference).
        cache (`DFlashDrafterCache`, optional): projected context of earlier steps; the new context is appended.

        Returns the normalised hidden states of the block rows; the target's `lm_head` turns them into logits.
        """
        if attention_mask is not None:
            # SDPA would cut a longer mask to the keys' length and mask the wrong slots without a word.
            cached = cache.context_length if cache is not None else 0
            num_keys = cached + context_features.shape[1] + block_embeddings.shape[1]
            if attention_mask.shape[-1] != num_keys:
                raise ValueError(
                    f"attention_mask covers {attention_mask.shape[-1]} keys but the drafter attends over {num_keys} "
                    "([cached context ; new context ; block]); give one entry per key."
                )
        context_features = self.hidden_norm(self.fc(context_features))
        position_ids = torch.cat([context_position_ids, block_position_ids], dim=1)
        position_embeddings = self.rotary_emb(block_embeddings, position_ids)
        sliding_mask = self._sliding_window_mask(position_ids, block_position_ids, attention_mask, cache)
        hidden_states = block_embeddings
        for layer in self.layers:
            mask = sliding_mask if layer.self_attn.sliding_window is not None else attention_mask
            hidden_states = layer(hidden_states, context_features, position_embeddings, mask, cache)
        if cache is not None:
            cache.advance(context_position_ids)
        return BaseModelOutput(last_hidden_state=self.norm(hidden_states))

    def _sliding_window_mask(self, position_ids, block_position_ids, attention_mask, cache):
        """`attention_mask` restricted to keys less than `sliding_window` positions before each block row.

        FlashAttention-2 applies the window itself (it gets `sliding_window`), so no mask is built for it.
        """
        window = self.config.sliding_window
        if (
            "sliding_attention" not in self.config.layer_types
            or self.config._attn_implementation == "flash_attention_2"
        ):
            return attention_mask
        past = cache.past_positions() if cache is not None else None
        key_positions = position_ids if past is None else torch.cat([past, position_ids], dim=1)
        if key_positions.shape[1] <= window:
            return attention_mask
        in_window = (block_position_ids[:, :, None] - key_positions[:, None, :]) < window
        in_window = in_window[:, None]
        if attention_mask is None:
            return in_window
        if attention_mask.dtype == torch.bool:
            return attention_mask & in_window
        return attention_mask.masked_fill(~in_window, torch.finfo(attention_mask.dtype).min)

    @classmethod
    def from_target(
        cls,
        target: PreTrainedModel,
        num_layers: int = 1,
        block_size: int = 16,
        mask_token_id: int | None = None,
        target_layer_ids: list[int] | None = None,
        num_target_features: int = 5,
        draft_vocab_ids=None,
        **config_overrides,
    ) -> "DFlashDraftModel":
        """A freshly initialised drafter that fits `target` (hidden size, heads, RoPE, vocabulary, default layers).

        `mask_token_id` defaults to the last row of the target's embedding table: in Qwen3-style vocabularies that
        row lies past the tokenizer's last special token and is free. `target_layer_ids` defaults to DFlash's
        spread of `num_target_features` layers (see `default_target_layer_ids`). `draft_vocab_ids` (optional): the
        target token ids the drafter may propose (a reduced draft vocabulary); default: all of them.
        """
        lm_config = text_config(target.config)
        if getattr(lm_config, "is_encoder_decoder", False):
            raise ValueError("DFlash drafters need a decoder-only target; got an encoder-decoder model.")
        embeddings = target.get_input_embeddings()
        if embeddings is None or target.get_output_embeddings() is None:
            raise ValueError(
                f"{type(target).__name__} has no input embeddings or no LM head; pass an *ForCausalLM model."
            )
        num_target_layers = lm_config.num_hidden_layers
        vocab_size = embeddings.weight.shape[0]
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(num_target_layers, num_target_features)
        if mask_token_id is None:
            mask_token_id = vocab_size - 1
        config_kwargs = dict(
            decoder_shape_kwargs(lm_config),
            vocab_size=vocab_size,  # the embedding table's rows (may be padded past config.vocab_size)
            num_hidden_layers=num_layers,
            block_size=block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=list(target_layer_ids),
            num_target_layers=num_target_layers,
        )
        if draft_vocab_ids is not None:
            config_kwargs["draft_vocab_size"] = len(draft_vocab_ids)
        config_kwargs.update(config_overrides)
        config = DFlashConfig(**config_kwargs)
        config._attn_implementation = getattr(target.config, "_attn_implementation", None) or "sdpa"
        drafter = cls(config)
        if draft_vocab_ids is not None:
            drafter.set_draft_vocabulary(draft_vocab_ids)
        param = next(target.parameters())
        return drafter.to(device=param.device, dtype=param.dtype)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """`PreTrainedModel.save_pretrained`, plus the carried core's code files next to the weights (`code_files`),
        so that the folder loads with `AutoModel.from_pretrained(folder, trust_remote_code=True)` anywhere."""
        if kwargs.get("push_to_hub"):
            raise ValueError(
                "save_pretrained(push_to_hub=True) would upload the folder before the DFlash code files are written "
                "next to it. Call drafter.push_to_hub(repo_id) instead, which uploads weights, config and code."
            )
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            write_code_files(save_directory)
