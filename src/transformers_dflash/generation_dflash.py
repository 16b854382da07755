"""DFlash decoding inside `generate()`: the candidate generator, the decoding loop and the generation hook.

This file is copied next to every checkpoint by `save_pretrained`, so it imports only torch and transformers.

`install_generation_hook()` (called when the modeling file is imported) wraps two methods of transformers'
`GenerationMixin` so that `target.generate(input_ids, assistant_model=drafter)` uses DFlash when `drafter` is a DFlash
drafter, and behaves exactly as before for every other assistant (a classic assistant model, prompt lookup, ...):

- `generate`: checks that the drafter fits the target and refuses what DFlash cannot do (beam search, several
  return sequences), with messages that say how to fix the call;
- `_assisted_decoding`: runs `dflash_decoding` below instead of transformers' batch-1 assisted loop.

One decoding step (`dflash_decoding`), for every unfinished row at once:

1. draft: the drafter fills [anchor, MASK x (block_size - 1)] in one forward, conditioned on the target features of
   the positions verified since its last step (`DFlashCandidateGenerator.draft`);
2. verify: one target forward over [anchor, drafts]; forward hooks on the chosen target layers capture their outputs,
   which become the drafter's context for the next step (no other hidden states are kept);
3. accept: the longest prefix of drafts equal to the target's own choices, plus the target's next ("bonus") token.
   Greedy: choices are the argmax of the processed logits. Sampling: choices are samples of the target's processed
   distribution, so every committed token is distributed exactly as in plain sampling (greedy proposals + "accept on
   equality" is the rejection rule of Leviathan et al. with a one-hot draft distribution);
4. commit: stopping criteria are applied token by token, so an EOS or a stop string inside a block ends the row
   exactly where plain `generate()` would; the caches drop the rejected positions.

Ragged acceptance across rows (the cache design): the target's KV cache and the drafter's context cache share one
"slot" layout. Every row appends the same number of slots per step; a row that accepted fewer drafts than the others
leaves masked slots ("holes") in the 2-D attention mask, and slots rejected by every row are cropped. Position ids
are tracked per row, so RoPE sees true positions despite holes and left padding. Finished rows leave the batch
(their cache rows are dropped), so they stop costing work. On CPUs a ragged batch is prefilled in groups of
similar lengths, without most of its padding, and laid out left-padded afterwards (`_grouped_prefill`); the loop
runs with CPU kernels for few-row products (`skinny_linears`) and masked grouped-query attention
(`packed_gqa_attention`).
"""

import contextlib
import copy
import functools
import inspect
import logging
import time
import weakref

import torch
from torch import nn
from torch.nn import functional as F
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

logger = logging.getLogger(__name__)

# Logits processors that read only the scores, never the input ids: they can run on all verified positions at once.
_SCORE_ONLY_PROCESSORS = {
    "TemperatureLogitsWarper",
    "TopKLogitsWarper",
    "TopPLogitsWarper",
    "MinPLogitsWarper",
    "TypicalLogitsWarper",
    "EpsilonLogitsWarper",
    "EtaLogitsWarper",
}


def text_config(config):
    """The language-model part of a config (multimodal models nest it; plain LMs return themselves)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


# Row counts for which `skinny_linear` takes the transposed product (measured faster, see `skinny_linear`).
_SKINNY_ROWS = (1, 256)


def skinny_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(input, weight, bias)`, computed as `(weight @ input^T)^T` for a few float32 rows on a CPU.

    A verification forward multiplies every weight matrix by a handful of rows (block width x batch). On CPUs, PyTorch
    runs `input @ weight^T` for 2..256 rows through an MKL GEMM that is much slower than streaming the weights once:
    measured on a 2-core AMD EPYC (SmolLM2-135M's 211 matrices, 2 threads), 2 rows cost 1.67x one row while the
    transposed product cost 0.75x, 8 rows 1.61x against 0.97x (`dflash bench --linear-kernels`, docs/benchmarks.md).
    One row goes through the same product as two copies of itself: MKL's matrix-vector product is slower than that
    two-column product (same table: one pass 54.6 ms against 69.9 ms). The output is made contiguous
    again (leaving it transposed in memory saved the copy but slowed the ops after it more). Same arithmetic, other
    summation order: results agree to float32 rounding, like any change of batch shape. Other devices, dtypes and
    row counts take `F.linear` unchanged.
    """
    rows = input.numel() // input.shape[-1] if input.dim() > 0 and input.shape[-1] else 0
    if (
        not _SKINNY_ROWS[0] <= rows <= _SKINNY_ROWS[1]
        or input.device.type != "cpu"
        or input.dtype != torch.float32
        or weight.dtype != torch.float32
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
    group (`repeat_kv`) before calling SDPA: at batch 16 with a 350-token cache that copies ~0.8 GB per forward, and
    a verification of 2 tokens cost ~1.8x a plain step (SmolLM2, 2-core CPU). Here the queries of a group are stacked
    instead, `[batch, kv_heads, groups * queries, head_dim]`, with the mask tiled to match: each query meets the same
    keys under the same mask, so the result is the same attention (float rounding aside). Measured per layer at batch
    16, 350 keys, 2 queries: 1.4 ms against 4.6 ms. Anything else goes to transformers' function unchanged.
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


def _decoder_layers(target: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(target).__name__} does not expose its decoder layers as `get_decoder().layers`; DFlash needs a "
            "decoder-only transformers model (Llama, Qwen2/3, Mistral, Gemma, ...) loaded with AutoModelForCausalLM."
        )
    return decoder, layers


def check_drafter_fits_target(drafter: nn.Module, target: nn.Module) -> None:
    """Raise a ValueError that says what to fix when `drafter` cannot draft for `target`.

    A drafter on another device or in another dtype than the target is fine: `DFlashCandidateGenerator` moves the
    small per-step tensors across (a float32 drafter next to a bfloat16 target is a common training set-up)."""
    config = drafter.config
    target_config = text_config(target.config)
    if getattr(target.config, "is_encoder_decoder", False):
        raise ValueError("DFlash drafters need a decoder-only target; this target is an encoder-decoder model.")
    if getattr(target, "_is_stateful", False):
        raise ValueError(
            f"{type(target).__name__} keeps recurrent state that cannot be rolled back after a rejected draft, so "
            "DFlash (like all speculative decoding) cannot verify drafts with it."
        )
    _, layers = _decoder_layers(target)
    embeddings, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    if lm_head is None:
        raise ValueError(f"{type(target).__name__} has no LM head; load the target with AutoModelForCausalLM.")
    if config.hidden_size != target_config.hidden_size:
        raise ValueError(
            f"The drafter's hidden_size is {config.hidden_size} but the target's is {target_config.hidden_size}: this "
            "drafter was built for another target. Use a drafter trained for this target, or build one with "
            "DFlashDraftModel.from_target(target)."
        )
    vocab_rows = embeddings.weight.shape[0]
    if config.vocab_size != vocab_rows:
        raise ValueError(
            f"The drafter's vocab_size is {config.vocab_size} but the target's embedding table has {vocab_rows} rows: "
            "the drafter borrows the target's embeddings and LM head, so both must use the same vocabulary."
        )
    if config.mask_token_id is None or not 0 <= config.mask_token_id < vocab_rows:
        raise ValueError(
            f"mask_token_id={config.mask_token_id} is not a row of the target's embedding table (0..{vocab_rows - 1}). "
            "Set `drafter.config.mask_token_id` to the id the drafter was trained with."
        )
    num_layers = len(layers)
    bad = [i for i in config.target_layer_ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"target_layer_ids {bad} are out of range for a target with {num_layers} layers (valid: 0..{num_layers - 1})."
        )
    if config.num_target_layers is not None and config.num_target_layers != num_layers:
        raise ValueError(
            f"This drafter was trained for a target with {config.num_target_layers} layers, but the target has "
            f"{num_layers}: it is not this target's drafter."
        )
    expected_in = len(config.target_layer_ids) * config.hidden_size
    if drafter.fc.in_features != expected_in:
        raise ValueError(
            f"The drafter's fc expects {drafter.fc.in_features} input features but {len(config.target_layer_ids)} "
            f"target layers x hidden {config.hidden_size} give {expected_in}: target_layer_ids do not match the weights."
        )


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


class DraftLengthPolicy:
    """How many of a block's drafts to verify (adaptive draft length). Verifying fewer drafts is always lossless.

    Verification cost grows with the number of tokens on CPUs and at large batch, so low-confidence drafts can cost
    more than they are expected to gain. Set `drafter.draft_length` to:

    - `None` (default): verify the whole block;
    - a float threshold `t`: verify drafts while the cumulative drafter confidence (the product of the drafter's
      probabilities of its own proposals) stays >= t;
    - `"auto"`: pick the length k (0 = verify no draft: a plain decoding step) that maximises expected tokens per
      second, `(1 + sum_{j<=k} P_j) / (draft + verify(k + 1))`, with `P_j` the cumulative confidence, `draft` the
      mean measured draft time and `verify(w)` the measured time of verifying w tokens in this generate() call: the
      mean of the steps of that width, else a least-squares line through all steps. The first two steps measure one
      draft (width 2) and no draft (width 1); wider blocks are tried when the line predicts that they pay, and are
      then measured. Exploring from the narrow end keeps a large batch, where a full block costs several plain steps,
      from paying for it just to learn that it does not pay. A table rather than a line, because on CPUs one token
      can be much cheaper than two while two to eight cost about the same. The draft's cost is the mean of the drafts
      after the first (the first one also reads the whole prompt's context).
      When drafting loses even so (the expected rate of the last drafted step is below a plain step's, e.g. at a
      large batch with doubtful drafts), the next steps skip the drafter altogether; it is asked again after 1, 2,
      4, ... 16 skipped steps, and drafting resumes as soon as it wins. Skipped steps keep their target features for
      the drafter's next context, so skipping costs no accuracy.

    Rows of a batch share one verification forward: with a threshold the widest row's choice wins; `"auto"` picks the
    length that maximises the expected tokens per second of the whole batch (the sum over rows).
    """

    def __init__(self, threshold: float | None = None, auto: bool = False):
        self.threshold, self.auto = threshold, auto
        self.samples: list[tuple[int, float]] = []  # (verified width, seconds of the verification and commit)
        self.draft_seconds: list[float] = []  # seconds of each draft
        self.draft_rate: float | None = None  # expected tokens/s per row of the last drafted step, as chosen
        self.skipped, self.backoff = 0, 1

    @classmethod
    def from_setting(cls, setting):
        if setting is None:
            return None
        if setting == "auto":
            return cls(auto=True)
        if isinstance(setting, (int, float)) and 0.0 <= float(setting) <= 1.0:
            return cls(threshold=float(setting))
        raise ValueError(
            f"drafter.draft_length={setting!r} is not valid: use None (whole block), a confidence threshold in "
            "[0, 1], or 'auto'."
        )

    def record(self, width: int, seconds: float, draft_seconds: float | None = None):
        """A step verified `width` tokens in `seconds`, after a draft of `draft_seconds` (None: no draft)."""
        self.samples.append((width, seconds))
        if draft_seconds is not None:
            self.draft_seconds.append(draft_seconds)

    def wants_draft(self) -> bool:
        """Whether to run the drafter this step (always, except in "auto" mode while drafting loses to plain steps)."""
        if not self.auto:
            return True
        if 1 not in {w for w, _ in self.samples} and self.samples:  # exploring a plain step: no draft to pay for
            return False
        if self.draft_rate is None:
            return True
        plain_cost = self.step_costs(1)[0]
        if self.draft_rate >= 1.0 / plain_cost:
            self.skipped, self.backoff = 0, 1
            return True
        if self.skipped < self.backoff:
            self.skipped += 1
            return False
        self.skipped, self.backoff = 0, min(2 * self.backoff, 16)  # ask the drafter again; wait longer if it loses
        return True

    def _cost_line(self):
        widths = {w for w, _ in self.samples}
        if len(widths) < 2:
            return None
        n = len(self.samples)
        mean_w = sum(w for w, _ in self.samples) / n
        mean_t = sum(t for _, t in self.samples) / n
        var = sum((w - mean_w) ** 2 for w, _ in self.samples)
        slope = max(sum((w - mean_w) * (t - mean_t) for w, t in self.samples) / var, 0.0)
        return mean_t - slope * mean_w, slope

    def step_costs(self, max_width: int) -> list[float] | None:
        """Estimated seconds of a step verifying w = 1 .. max_width tokens (None before two widths were measured)."""
        line = self._cost_line()
        if line is None:
            return None
        intercept, slope = line
        totals: dict[int, list[float]] = {}
        for w, t in self.samples:
            totals.setdefault(w, []).append(t)
        measured = {w: sum(ts) / len(ts) for w, ts in totals.items()}
        costs = []
        for w in range(1, max_width + 1):
            below = [m for m in measured if m < w]
            above = [m for m in measured if m > w]
            if w in measured:
                costs.append(measured[w])
            elif below and above:  # between two measured widths: interpolate
                lo, hi = max(below), min(above)
                costs.append(measured[lo] + (measured[hi] - measured[lo]) * (w - lo) / (hi - lo))
            else:
                costs.append(max(intercept + slope * w, 1e-9))
        return costs

    def num_to_verify(self, confidence: torch.Tensor, paid_draft: bool = True) -> int:
        """Drafts to verify, from per-row confidences `[rows, num_draft]`. `paid_draft=False`: the drafter did not run
        this step (only copied drafts, see `NgramLookup`), so its cost and its rate are left out."""
        num_draft = confidence.shape[1]
        cumulative = confidence.cumprod(dim=1)
        if not self.auto:
            return int((cumulative >= self.threshold).sum(dim=1).max())
        widths = {w for w, _ in self.samples}
        if 2 not in widths:  # explore: one draft ...
            return min(1, num_draft)
        if 1 not in widths:  # ... then no draft at all
            return 0
        drafts = self.draft_seconds[1:] or self.draft_seconds  # the first draft also read the prompt's context
        draft = sum(drafts) / len(drafts) if drafts and paid_draft else 0.0
        costs = [draft + c for c in self.step_costs(num_draft + 1)]
        costs = torch.tensor(costs, dtype=torch.float32, device=confidence.device)
        gained = 1 + torch.cat([cumulative.new_zeros(cumulative.shape[0], 1), cumulative.cumsum(dim=1)], dim=1)
        # Rows share one forward: maximise the whole batch's expected tokens per second, not the greediest row's.
        rate = gained.float().sum(dim=0) / costs
        best = int(rate.argmax())
        if paid_draft:
            self.draft_rate = float(rate[best]) / confidence.shape[0]
        return best


class NgramLookup:
    """Drafts copied from the sequence itself (prompt lookup), merged into DFlash's blocks: `drafter.ngram_lookup = n`.

    When a row's last n (then n - 1, ... 1) committed tokens occurred earlier in that row, the tokens that followed
    their most recent earlier occurrence replace the head of the row's block. Small models often repeat themselves
    (lists, code, loops), and there such copies are accepted far more often than a weak drafter's guesses. Like any
    proposal they are verified by the target, so the output is unchanged.

    With `draft_length="auto"` each copied token's confidence is its depth's measured acceptance rate in this call
    (smoothed towards the rate of the depth before), so the policy verifies copies as far as they have been paying
    off; when the drafter is skipped, copies are still proposed (they cost no drafter forward).
    """

    def __init__(self, max_ngram_size: int, block_size: int):
        self.max_ngram_size = max_ngram_size
        self.hits = [0] * block_size  # copies accepted at depth j ...
        self.tries = [0] * block_size  # ... out of copies verified at depth j with all earlier ones accepted
        self.copied: list[int] = []  # per row of the last step: tokens copied into the block head

    def _continuation(self, tokens: torch.Tensor, num_draft: int) -> torch.Tensor | None:
        for n in range(min(self.max_ngram_size, tokens.shape[0] - 1), 0, -1):
            windows = tokens.unfold(0, n, 1)[:-1]  # every earlier n-gram (the suffix itself excluded)
            found = (windows == tokens[-n:]).all(dim=1).nonzero()
            if found.numel():
                start = int(found[-1]) + n
                return tokens[start : start + num_draft]
        return None

    @property
    def acceptance(self) -> torch.Tensor:
        """The confidence given a copy at each depth: the measured rate at which a copy is accepted once the copies
        before it were, shrunk towards the rate of the depth before (1/2 for the first). An untried depth looks like
        the last tried one, so copies that keep being accepted (a repetition loop) get verified ever deeper, as prompt
        lookup would."""
        rates, prior = [], 0.5
        for hits, tries in zip(self.hits, self.tries):
            prior = (hits + 2 * prior) / (tries + 2)
            rates.append(prior)
        return torch.tensor(rates)

    def merge(self, sequences, active, lengths, drafts, confidence, num_draft: int):
        """Drafts `[rows, num_draft]` (and per-token confidences) with each row's copied continuation at its head."""
        rows = len(active)
        acceptance = self.acceptance
        if drafts.shape[1] < num_draft:  # the drafter did not run this step: pad, with zero confidence
            drafts = torch.cat([drafts, drafts.new_zeros(rows, num_draft - drafts.shape[1])], dim=1)
        confidence = confidence.clone() if confidence is not None else torch.zeros(rows, num_draft)
        self.copied = [0] * rows
        for i, r in enumerate(active):
            copy = self._continuation(sequences[r, : lengths[r]], num_draft)
            if copy is None:
                continue
            n = copy.shape[0]
            drafts[i, :n] = copy
            confidence[i, :n] = acceptance[:n]
            self.copied[i] = n
        return drafts, confidence.to(drafts.device)

    def record(self, accepted: list[int], verified: int):
        """After verification: `accepted[i]` drafts of row i were accepted, `verified` drafts were checked."""
        for copied, a in zip(self.copied, accepted):
            for j in range(min(copied, verified, a + 1)):
                self.tries[j] += 1
                self.hits[j] += j < a


def check_ngram_lookup(value):
    """`value` if it is a valid `drafter.ngram_lookup` (None = off, else the longest n-gram to match), else ValueError."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(
            f"drafter.ngram_lookup={value!r} is not valid: use None (off) or the longest n-gram to match, e.g. 2."
        )
    return value


class DFlashCandidateGenerator(CandidateGenerator):
    """Drafts a block of tokens per step with a DFlash drafter, from the target's own hidden states.

    It registers forward hooks on the target layers named by `drafter.config.target_layer_ids`, so every target
    forward (prefill or verification) leaves exactly those layers' outputs in `captured_features()`; no other hidden
    states are materialised. The drafter's context cache holds the projected features of the verified positions only.

    Two ways to use it:
    - `dflash_decoding` (what `target.generate(..., assistant_model=drafter)` runs) calls `draft` directly;
    - the standard `CandidateGenerator` protocol (`get_candidates` / `update_candidate_strategy`), for a batch-1
      assisted loop such as transformers' own: the first call returns no candidates so that the target prefills.

    `drafter.last_acceptance_lengths` records, per target forward, the number of tokens it committed: 1 for the
    prefill, then accepted drafts + 1 (the bonus token) per verification step; so its sum is the number of new tokens.
    For a batch, it is one such list per row.
    """

    def __init__(self, drafter: nn.Module, target: nn.Module, generation_config=None, logits_processor=None, **kwargs):
        self.drafter = drafter
        self.config = drafter.config
        self.block_size = self.config.block_size
        self.embed_tokens = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        # The rows of the LM head the drafter scores (a reduced draft vocabulary, or all of them), sliced once.
        self.head_weight, self.head_bias = drafter.draft_head(self.lm_head)
        self.fast_cpu_linears = getattr(drafter, "fast_cpu_linears", True)
        self.head_linear = skinny_linear if self.fast_cpu_linears else F.linear
        self.draft_vocab_ids, self.mask_index = drafter.draft_vocab_ids, self.config.mask_token_id
        if self.draft_vocab_ids is not None:
            self.draft_vocab_ids = self.draft_vocab_ids.to(self.head_weight.device)
            self.mask_index = (self.draft_vocab_ids == self.config.mask_token_id).nonzero().flatten()
        self.max_length = getattr(generation_config, "max_length", None)
        self.logits_processor = logits_processor
        self.cache = DFlashDrafterCache(self.config.num_hidden_layers)
        self.draft_length_policy = DraftLengthPolicy.from_setting(getattr(drafter, "draft_length", None))
        lookup = check_ngram_lookup(getattr(drafter, "ngram_lookup", None))
        self.ngram_lookup = NgramLookup(lookup, self.block_size) if lookup else None
        self.last_confidence = None
        drafter_param = next(drafter.parameters())
        self.drafter_device, self.drafter_dtype = drafter_param.device, drafter_param.dtype
        _warn_slow_cpu_dtype(self.drafter_dtype, self.head_weight.dtype, self.drafter_device)
        self.num_captured_valid = 0

        # Forward hooks keep the chosen layers' outputs. hidden_states[i + 1] in transformers is the output of layer
        # i, except for the last layer, whose entry is the final-normed output: hook the norm there.
        decoder, layers = _decoder_layers(target)
        self._captured: list[torch.Tensor | None] = [None] * len(self.config.target_layer_ids)
        handles = []
        for slot, layer_id in enumerate(self.config.target_layer_ids):
            module = decoder.norm if layer_id == len(layers) - 1 and hasattr(decoder, "norm") else layers[layer_id]
            handles.append(module.register_forward_hook(functools.partial(_capture_output, self._captured, slot)))
        # The hooks close over the list, not over self, so they go away as soon as the generator does.
        self._finalizer = weakref.finalize(self, _remove_hooks, handles)
        self.drafter.last_acceptance_lengths = []

    def close(self):
        """Remove the hooks from the target (also done automatically when the generator is garbage collected)."""
        self._finalizer()

    def captured_features(self) -> torch.Tensor:
        """Selected target layers' outputs of the last target forward, concatenated: [batch, seq, K * hidden]."""
        return torch.cat(self._captured, dim=-1)

    @torch.no_grad()
    def draft(
        self,
        anchor_ids: torch.LongTensor,
        anchor_position_ids: torch.LongTensor,
        context_features: torch.Tensor,
        context_position_ids: torch.LongTensor,
        context_mask: torch.Tensor | None = None,
        num_draft: int | None = None,
    ) -> torch.LongTensor:
        """Propose `num_draft` (<= block_size - 1) tokens after each row's anchor, in one drafter forward.

        anchor_ids `[batch]`: last committed token of each row, not yet seen by the target; anchor_position_ids
            `[batch]`: its position (the block occupies anchor_position .. anchor_position + block_size - 1).
        context_features `[batch, n, K * hidden]`: target features of the positions verified since the last draft.
        context_position_ids `[batch, n]`: their positions.
        context_mask `[batch, cached + n]` (optional): False for context slots a row must not see (padding, holes).
        """
        num_draft = self.block_size - 1 if num_draft is None else num_draft
        batch = anchor_ids.shape[0]
        offsets = torch.arange(self.block_size, device=anchor_ids.device)
        block_ids = torch.full((batch, self.block_size), self.config.mask_token_id, device=anchor_ids.device)
        block_ids[:, 0] = anchor_ids
        block_position_ids = anchor_position_ids[:, None] + offsets
        attention_mask = None
        if context_mask is not None:
            # Padded or rejected slots may hold garbage (even NaN from fully masked rows): keep it out of the keys.
            new_valid = context_mask[:, -context_features.shape[1] :].bool()
            context_features = context_features.masked_fill(~new_valid[..., None], 0)
            keys_valid = torch.cat([context_mask.bool(), context_mask.new_ones(batch, self.block_size).bool()], dim=1)
            attention_mask = keys_valid[:, None, None, :].expand(batch, 1, self.block_size, keys_valid.shape[1])
        device, dtype = self.drafter_device, self.drafter_dtype
        hidden = self.drafter(
            block_embeddings=self.embed_tokens(block_ids).to(device, dtype),
            context_features=context_features.to(device, dtype),
            block_position_ids=block_position_ids.to(device),
            context_position_ids=context_position_ids.to(device),
            attention_mask=attention_mask.to(device) if attention_mask is not None else None,
            cache=self.cache,
        ).last_hidden_state
        # Only the rows we will verify go through the (large) LM head.
        hidden = hidden[:, 1 : 1 + num_draft].to(self.head_weight.device, self.head_weight.dtype)
        logits = self.head_linear(hidden, self.head_weight, self.head_bias)
        # The mask token is the drafter's input placeholder; an (untrained) drafter tends to echo it back.
        logits[..., self.mask_index] = torch.finfo(logits.dtype).min
        self.last_confidence = None
        if self.draft_length_policy is not None:
            # Probability the drafter gives its own proposal: a cheap estimate of each draft's chance of acceptance.
            self.last_confidence = torch.softmax(logits.float(), dim=-1).amax(dim=-1).to(anchor_ids.device)
        drafts = logits.argmax(dim=-1)
        if self.draft_vocab_ids is not None:
            drafts = self.draft_vocab_ids[drafts]
        return drafts.to(anchor_ids.device)

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs) -> tuple[torch.LongTensor, None]:
        """`CandidateGenerator` protocol (batch 1): the full sequence followed by the drafted tokens.

        Returns no draft logits: proposals are greedy, and a sampling loop must then "sample the target and accept
        on equality", which keeps sampling exact.
        """
        if self._captured[0] is None:  # the target has not run yet: no context to draft from
            return input_ids, None
        num_draft = self.block_size - 1
        if self.max_length is not None:
            num_draft = min(num_draft, self.max_length - input_ids.shape[1] - 1)
        verified = input_ids.shape[1] - 1  # every position but the anchor has been through the target
        new = verified - self.cache.context_length
        if num_draft <= 0 or new <= 0:
            return input_ids, None
        positions = torch.arange(self.cache.context_length, verified, device=input_ids.device)[None]
        anchor_position = torch.full((input_ids.shape[0],), verified, device=input_ids.device)
        features = self.captured_features()[:, :new]
        drafts = self.draft(input_ids[:, -1], anchor_position, features, positions, num_draft=num_draft)
        return torch.cat([input_ids, drafts.to(input_ids.device)], dim=1), None

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        self.drafter.last_acceptance_lengths.append(int(num_matches) + 1)


_warned_dtypes: set = set()


def _warn_slow_cpu_dtype(drafter_dtype: torch.dtype, target_dtype: torch.dtype, device: torch.device) -> None:
    """Warn (once per dtype pair) when a half-precision drafter runs on CPU next to a float32 target: CPU bfloat16 /
    float16 matrix products are slower than float32 ones on most CPUs, so the drafter costs more than it should."""
    key = (drafter_dtype, target_dtype)
    half = drafter_dtype in (torch.bfloat16, torch.float16)
    if device.type != "cpu" or target_dtype != torch.float32 or not half or key in _warned_dtypes:
        return
    _warned_dtypes.add(key)
    logger.warning(
        "The drafter's weights are %s and the target's float32, on CPU, where half-precision matrix products are "
        "usually slower than float32 ones, so drafting costs more than it needs to. Load the drafter with the "
        "target's dtype, e.g. AutoModel.from_pretrained(path, trust_remote_code=True, dtype=target.dtype).",
        str(drafter_dtype).replace("torch.", ""),
    )


def _capture_output(store: list, slot: int, module, args, output):
    store[slot] = output[0] if isinstance(output, tuple) else output


def _remove_hooks(handles):
    for handle in handles:
        handle.remove()


def _cache_keyword(target: nn.Module) -> str:
    """transformers 5.24 renamed the forward keyword `past_key_values` to `cache`."""
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


def _new_target_cache(target: nn.Module, model_kwargs: dict, generation_config):
    """A fresh dynamic cache of full-attention layers: every layer of it can be cropped after a rejected draft.

    Sliding-window targets still attend within their window: their masks come from the config, not the cache.
    """
    from transformers.cache_utils import DynamicCache

    given = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if given is not None and given.get_seq_length() > 0:
        raise ValueError(
            "DFlash decoding cannot continue from a pre-filled cache: it needs the target's hidden states of the "
            "whole prompt. Pass the full prompt without `past_key_values`/`cache`."
        )
    if given is not None and not isinstance(given, DynamicCache):
        raise ValueError(
            f"DFlash decoding needs a cache it can crop after rejected drafts; {type(given).__name__} cannot be "
            "cropped. Do not pass a cache object (a DynamicCache is created for you)."
        )
    implementation = getattr(generation_config, "cache_implementation", None)
    if implementation not in (None, "dynamic", "dynamic_full"):
        raise ValueError(
            f"cache_implementation={implementation!r} cannot be cropped after rejected drafts; DFlash decoding needs a "
            "dynamic cache. Remove `cache_implementation` from the generate() call or generation config."
        )
    lm_config = text_config(target.config)
    layer_types = set(getattr(lm_config, "layer_types", None) or [])
    if layer_types - {"full_attention", "sliding_attention", "chunked_attention"}:
        raise ValueError(
            f"The target has {sorted(layer_types)} layers; recurrent or linear-attention state cannot be rolled back "
            "after a rejected draft, so DFlash supports attention-only targets."
        )
    return DynamicCache()


def _apply_processors(logits_processor, sequences, active, lengths, candidates, logits):
    """Processed scores of every verified position, as plain `generate()` would compute them one token at a time.

    sequences `[batch, max_len]`: committed tokens (left-padded prompt first) of every ORIGINAL row; active: the
    original row of each active row; lengths: committed tokens per original row (host ints); candidates
    `[rows, n]`: [anchor, drafts]; logits `[rows, n, vocab]` (float32). Position i of active row a is processed with
    the ids `sequences[r, :lengths[r]] + candidates[a, 1:i + 1]`, the prefix it would have had in plain decoding.
    Processors are built for the whole batch (some keep per-row settings), so each call sees `batch` rows: all the
    real rows when they are in step, else copies of the one row being processed.
    """
    if not logits_processor:
        return logits
    rows, n, vocab = logits.shape
    if all(type(p).__name__ in _SCORE_ONLY_PROCESSORS for p in logits_processor):
        flat = logits_processor(candidates.reshape(-1, 1), logits.reshape(-1, vocab))
        return flat.view(rows, n, vocab)
    batch = sequences.shape[0]
    processed = torch.empty_like(logits)
    in_step = rows == batch and len({lengths[r] for r in active}) == 1 and active == list(range(batch))
    for i in range(n):
        if in_step:
            ids = torch.cat([sequences[:, : lengths[0]], candidates[:, 1 : i + 1]], dim=1)
            processed[:, i] = logits_processor(ids, logits[:, i].clone())
            continue
        for a, r in enumerate(active):
            ids = torch.cat([sequences[r, : lengths[r]], candidates[a, 1 : i + 1]])
            scores = logits[a, i].expand(batch, vocab).clone()
            processed[a, i] = logits_processor(ids.expand(batch, -1), scores)[r]
    return processed


def _stop_lengths(stopping_criteria, sequences, active, lengths, new_tokens, num_new, eos_token_id):
    """How many of each row's `num_new` candidate tokens to commit, and whether the row stops there.

    Applies the stopping criteria after each token, as plain `generate()` does, so a stop inside a block ends the row
    on that token. EOS and max length are handled with tensor ops; other criteria (stop strings, custom ones) are
    called on each prefix (with `sequences`/`active`/`lengths` as in `_apply_processors`).
    """
    rows, width = new_tokens.shape
    offsets = torch.arange(width, device=new_tokens.device)
    stopped = torch.zeros(rows, dtype=torch.bool, device=new_tokens.device)
    if eos_token_id is not None:
        is_eos = torch.isin(new_tokens, eos_token_id.to(new_tokens.device)) & (offsets < num_new[:, None])
        first_eos = torch.where(is_eos, offsets, width).min(dim=1).values
        stopped = first_eos < width
        num_new = torch.where(stopped, first_eos + 1, num_new)
    num_new_host, stopped_host = num_new.tolist(), stopped.tolist()  # the step's one host sync
    others = [c for c in stopping_criteria if not isinstance(c, (EosTokenCriteria, MaxLengthCriteria))]
    if others:
        batch = sequences.shape[0]
        for a, r in enumerate(active):
            for j in range(1, num_new_host[a] + 1):
                ids = torch.cat([sequences[r, : lengths[r]], new_tokens[a, :j]]).expand(batch, -1)
                if any(bool(c(ids, None)[r]) for c in others):
                    num_new_host[a], stopped_host[a] = j, True
                    break
    return num_new_host, stopped_host


def _check_padding(attention_mask: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor | None:
    if attention_mask is None:
        return None
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has {tuple(input_ids.shape)}; "
            "pass the mask the tokenizer returned with these ids."
        )
    mask = attention_mask.bool()
    if bool(mask.all()):
        return None
    # Left padding only: once a row's mask turns on it stays on.
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError(
            "The attention mask has padding on the right (or holes). Decoder-only generation needs LEFT padding: "
            "create the tokenizer with padding_side='left' (or set tokenizer.padding_side = 'left') and re-tokenize."
        )
    if bool((~mask[:, -1]).any()):
        raise ValueError("A prompt in the batch is empty (its attention mask is all zeros); remove it from the batch.")
    return mask


@torch.no_grad()
def dflash_decoding(
    target: nn.Module,
    drafter: nn.Module,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    **model_kwargs,
):
    """Speculative decoding with a DFlash drafter; called by `target.generate(..., assistant_model=drafter)`.

    Receives what `generate()` prepared (processors, stopping criteria, generation config with max_length) and
    returns what plain `generate()` would: the same tensor, or a `GenerateDecoderOnlyOutput` with scores/logits.
    """
    if synced_gpus:
        raise ValueError("DFlash decoding does not support synced_gpus (DeepSpeed ZeRO-3 / FSDP generation).")
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError(
            "output_attentions / output_hidden_states are not available with DFlash decoding (it keeps only the "
            "drafter's target layers). Drop them, or generate without assistant_model to inspect the target."
        )
    batch, prompt_len = input_ids.shape
    if streamer is not None and batch > 1:
        raise ValueError("A streamer needs a batch of one prompt; DFlash rows advance by different amounts per step.")
    max_positions = drafter.config.max_position_embeddings
    attention_mask = _check_padding(model_kwargs.get("attention_mask"), input_ids)
    prompt_lengths = attention_mask.sum(-1) if attention_mask is not None else torch.full((batch,), prompt_len)
    if int(prompt_lengths.max()) >= max_positions:
        raise ValueError(
            f"A prompt has {int(prompt_lengths.max())} tokens but the drafter handles at most {max_positions} "
            "positions (max_position_embeddings). Shorten the prompt or generate without the drafter."
        )

    device = input_ids.device
    do_sample = generation_config.do_sample
    eos_token_id = getattr(generation_config, "_eos_token_tensor", None)
    pad_token_id = getattr(generation_config, "_pad_token_tensor", None)
    pad_token_id = int(pad_token_id) if pad_token_id is not None else 0
    max_new_tokens = generation_config.max_length - prompt_len
    return_dict = generation_config.return_dict_in_generate
    keep_scores = return_dict and generation_config.output_scores
    keep_logits = return_dict and generation_config.output_logits

    cache = _new_target_cache(target, model_kwargs, generation_config)
    # Sliding-window layers measure their window in cache slots; holes left by ragged acceptance would shrink the
    # window of the rows that accepted less. For such targets, batched rows commit the same number of tokens per step.
    align_rows = batch > 1 and _has_sliding_window(target)
    cache_kwarg = _cache_keyword(target)
    generator = DFlashCandidateGenerator(drafter, target, generation_config, logits_processor)
    block_size = generator.block_size

    # Committed tokens per ORIGINAL row, prompt (with its left padding) first; `lengths` counts them per row.
    sequences = torch.full((batch, prompt_len + max_new_tokens), pad_token_id, dtype=input_ids.dtype, device=device)
    sequences[:, :prompt_len] = input_ids
    lengths = [prompt_len] * batch
    acceptance = [[] for _ in range(batch)]
    row_scores = [[] for _ in range(batch)] if keep_scores else None
    row_logits = [[] for _ in range(batch)] if keep_logits else None

    def target_forward(ids, position_ids, mask, keep, into=cache):
        return target(
            input_ids=ids,
            position_ids=position_ids,
            attention_mask=mask,
            use_cache=True,
            logits_to_keep=keep,
            **{cache_kwarg: into},
        ).logits

    def commit(active, choices, num_new, stopped, raw, processed):
        """Write each row's accepted tokens; return the rows that continue."""
        continuing = []
        for i, (r, k) in enumerate(zip(active, num_new)):
            sequences[r, lengths[r] : lengths[r] + k] = choices[i, :k]
            lengths[r] += k
            acceptance[r].append(k)
            if keep_scores:
                row_scores[r].extend(processed[i, :k].unbind(0))
            if keep_logits:
                row_logits[r].extend(raw[i, :k].unbind(0))
            if not stopped[i] and lengths[r] < prompt_len + max_new_tokens:
                continuing.append(i)
        if streamer is not None:
            streamer.put(choices[0, : num_new[0]].cpu())
        return continuing

    # Verification multiplies every weight by a few rows: on CPUs the transposed product is much faster
    # (`skinny_linear`), and attention over a masked batch skips a copy of the cache (`packed_gqa_sdpa`).
    use_kernels = generator.fast_cpu_linears and device.type == "cpu"
    with cpu_kernels(target, drafter) if use_kernels else contextlib.nullcontext():
        try:
            # Prefill: the whole prompt through the target; the hooks keep the drafter's context features.
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
                mask = attention_mask.long()
            else:
                position_ids = torch.arange(prompt_len, device=device).expand(batch, -1)
                mask = None
            groups = _prefill_groups(mask, target) if mask is not None else None
            if groups is not None:
                raw, prompt_features = _grouped_prefill(target_forward, generator, input_ids, mask, groups, cache)
            else:
                raw = target_forward(input_ids, position_ids, mask, 1)[:, -1:]
                prompt_features = generator.captured_features()
            raw = raw.float()
            processed = logits_processor(input_ids, raw[:, 0].clone())[:, None] if logits_processor else raw
            choices = _choose(processed, do_sample)
            active = list(range(batch))
            num_new, stopped = _stop_lengths(
                stopping_criteria, sequences, active, lengths, choices, torch.ones(batch, dtype=torch.long, device=device),
                eos_token_id,
            )
            keep = commit(active, choices, num_new, stopped, raw, processed)

            anchor = choices[:, 0]
            next_position = prompt_lengths.to(device)  # position of each row's anchor
            context = prompt_features
            context_positions = position_ids
            context_mask = mask  # validity of the target cache slots (and of the drafter's context slots); None = all

            while keep:
                if len(keep) < len(active):  # finished rows leave the batch
                    index = torch.tensor(keep, device=device)
                    active = [active[i] for i in keep]
                    cache.batch_select_indices(index)
                    generator.cache.batch_select_indices(index)
                    anchor, next_position = anchor[index], next_position[index]
                    context, context_positions = context[index], context_positions[index]
                    context_mask = context_mask[index] if context_mask is not None else None
                rows = len(active)
                budget = max(prompt_len + max_new_tokens - lengths[r] for r in active)
                num_draft = min(block_size - 1, budget - 1)

                # 1. draft (optionally keep only the drafts worth verifying, or skip the drafter when it does not pay)
                policy = generator.draft_length_policy
                step_start = time.perf_counter()
                drafted = num_draft > 0 and (policy is None or policy.wants_draft())
                confidence = None
                if drafted:
                    drafts = generator.draft(anchor, next_position, context, context_positions, context_mask, num_draft)
                    confidence = generator.last_confidence
                else:
                    drafts = anchor.new_empty(rows, 0)
                lookup = generator.ngram_lookup if num_draft > 0 else None
                if lookup is not None:
                    drafts, merged = lookup.merge(sequences, active, lengths, drafts, confidence, num_draft)
                    confidence = merged if policy is not None else None
                if confidence is not None:
                    drafts = drafts[:, : policy.num_to_verify(confidence, paid_draft=drafted)]  # synchronises
                verify_start = time.perf_counter()
                # 2. verify [anchor, drafts] in one target forward
                candidates = torch.cat([anchor[:, None], drafts], dim=1)
                width = candidates.shape[1]
                block_positions = next_position[:, None] + torch.arange(width, device=device)
                if context_mask is not None:
                    context_mask = torch.cat([context_mask, context_mask.new_ones(rows, width)], dim=1)
                raw = target_forward(candidates, block_positions, context_mask, width).float()
                processed = _apply_processors(logits_processor, sequences, active, lengths, candidates, raw)
                choices = _choose(processed, do_sample)
                # 3. accept the longest matching prefix, plus the bonus token
                accepted = (drafts == choices[:, :-1]).long().cumprod(dim=1).sum(dim=1)
                budgets = torch.tensor([prompt_len + max_new_tokens - lengths[r] for r in active], device=device)
                num_new = torch.minimum(accepted + 1, budgets)
                if lookup is not None:
                    lookup.record(accepted.tolist(), drafts.shape[1])
                num_new, stopped = _stop_lengths(stopping_criteria, sequences, active, lengths, choices, num_new, eos_token_id)
                if policy is not None:  # `_stop_lengths` synced: the step's time is known
                    draft_seconds = verify_start - step_start if drafted else None
                    policy.record(width, time.perf_counter() - verify_start, draft_seconds)
                if align_rows:
                    num_new = _align_continuing_rows(num_new, stopped, budgets.tolist())
                # 4. commit, then keep the slots that hold a verified token for at least one continuing row
                keep = commit(active, choices, num_new, stopped, raw, processed)
                if not keep:
                    break
                kept_slots = max(num_new[i] for i in keep)  # anchor + accepted drafts of the longest continuing row
                if width > kept_slots:
                    cache.crop(-(width - kept_slots))
                if context_mask is not None or min(num_new) < kept_slots:  # some row left holes: track them
                    num_kept = torch.tensor(num_new, device=device).clamp(max=kept_slots)
                    verified = torch.arange(kept_slots, device=device)[None] < num_kept[:, None]
                    if context_mask is None:
                        total = cache.get_seq_length()
                        context_mask = torch.ones(rows, total - kept_slots, dtype=torch.long, device=device)
                    else:
                        context_mask = context_mask[:, : context_mask.shape[1] - width]
                    context_mask = torch.cat([context_mask, verified.long()], dim=1)
                # The drafter's next context: the features of the slots verified since its last draft.
                new_context = generator.captured_features()[:, :kept_slots]
                new_positions = block_positions[:, :kept_slots]
                if drafted:
                    context, context_positions = new_context, new_positions
                else:
                    context = torch.cat([context, new_context], dim=1)
                    context_positions = torch.cat([context_positions, new_positions], dim=1)
                index = torch.tensor(num_new, device=device) - 1
                anchor = choices.gather(1, index[:, None])[:, 0]
                next_position = next_position + index + 1
        finally:
            generator.close()
    if streamer is not None:
        streamer.end()

    drafter.last_acceptance_lengths = acceptance[0] if batch == 1 else acceptance
    output_ids = sequences[:, : max(lengths)]
    if not return_dict:
        return output_ids
    return _generate_output(output_ids, row_scores, row_logits, cache, prompt_len, max(lengths) - prompt_len)


def _prefill_groups(mask: torch.Tensor, target: nn.Module) -> list[list[int]] | None:
    """Rows of a left-padded batch to prefill together, each group cut to its own longest prompt; None: prefill the
    padded batch in one forward (see `_grouped_prefill`).

    On CPUs a forward costs in proportion to its tokens, padding included: a batch of 16 MT-Bench prompts (49 to 286
    tokens) is 4,576 slots for 1,401 tokens. But a forward of few tokens uses the CPU less well than a long one
    (prefilling 4 or 8 of those prompts one by one was measured slower than their padded batch), so rows are grouped
    by length, longest first, while a group's slots stay within 1.25x its tokens, and the groups are used only if
    they save a fifth of the slots. Measured on SmolLM2 (2-core CPU): the batch of 16 above becomes 3 forwards over
    1,638 slots, 2.9 s instead of 9.4 s; the first 8 of its prompts, 2 forwards over 643 of 848 slots, 1.46 s instead
    of 1.72 s; the first 4 (300 of 360 slots: 0.90 s instead of 0.78 s) keep the padded prefill. Accelerators run the
    padded batch in parallel, and sliding-window layers measure their window in cache slots, so both keep it too.
    """
    if mask.device.type != "cpu" or mask.shape[0] == 1 or _has_sliding_window(target):
        return None
    lengths = mask.sum(-1).tolist()
    groups: list[list[int]] = []
    for row in sorted(range(len(lengths)), key=lambda r: -lengths[r]):
        group = groups[-1] if groups else None
        if group and (len(group) + 1) * lengths[group[0]] <= 1.25 * (sum(lengths[r] for r in group) + lengths[row]):
            group.append(row)
        else:
            groups.append([row])
    slots = sum(len(group) * lengths[group[0]] for group in groups)
    return groups if slots <= 0.8 * mask.numel() else None  # a forward more must save a fifth of the slots


def _grouped_prefill(target_forward, generator, input_ids, mask, groups, cache):
    """Prefill each group of rows (`_prefill_groups`) in its own forward, cut to its longest prompt, then lay the
    groups' caches and features out as one left-padded batch. `target_forward(ids, position_ids, mask, keep, into)`
    runs the target into the cache `into` and returns its logits.

    Gives the same cache layout as a padded prefill of the whole batch (padding slots stay masked; those beyond a
    group's width hold zeros). Returns the last position's logits `[batch, 1, vocab]` and the drafter's context
    features `[batch, prompt_len, K * hidden]`, rows in their original order.
    """
    from transformers.cache_utils import DynamicCache

    prompt_len = input_ids.shape[1]
    logits, features, group_caches = [], [], []
    for rows in groups:
        index = torch.tensor(rows, device=input_ids.device)
        width = int(mask[index].sum(-1).max())
        group_mask = mask[index, prompt_len - width :]
        group_cache = DynamicCache()
        position_ids = (group_mask.cumsum(-1) - 1).clamp(min=0)
        group_attention = None if bool(group_mask.all()) else group_mask
        ids = input_ids[index, prompt_len - width :]
        logits.append(target_forward(ids, position_ids, group_attention, 1, group_cache)[:, -1:])
        features.append(generator.captured_features())
        group_caches.append(group_cache)
    order = torch.tensor([r for rows in groups for r in rows], device=input_ids.device).argsort()

    def left_pad(tensors):  # [rows, ..., width, d] -> zeros before each group's slots up to prompt_len; batch order
        padded = [F.pad(t, (0, 0, prompt_len - t.shape[-2], 0)) for t in tensors]
        return torch.cat(padded)[order]

    for layer_idx in range(len(group_caches[0].layers)):
        keys = left_pad([c.layers[layer_idx].keys for c in group_caches])
        values = left_pad([c.layers[layer_idx].values for c in group_caches])
        cache.update(keys, values, layer_idx)
    return torch.cat(logits)[order], left_pad(features)


def _has_sliding_window(target: nn.Module) -> bool:
    config = text_config(target.config)
    if getattr(config, "sliding_window", None) is None or getattr(config, "use_sliding_window", True) is False:
        return False
    layer_types = getattr(config, "layer_types", None)
    return layer_types is None or "sliding_attention" in layer_types


def _align_continuing_rows(num_new: list[int], stopped: list[bool], budgets: list[int]) -> list[int]:
    """Cut every continuing row to the smallest number of new tokens among them (rows that end keep theirs).

    Committing fewer verified tokens than accepted is always correct: the row simply drafts again from there.
    """
    continuing = [i for i, k in enumerate(num_new) if not stopped[i] and k < budgets[i]]
    if not continuing:
        return num_new
    least = min(num_new[i] for i in continuing)
    return [least if i in continuing else k for i, k in enumerate(num_new)]


def _choose(processed: torch.Tensor, do_sample: bool) -> torch.LongTensor:
    """The target's choice at every position: argmax, or one sample per position of softmax(processed)."""
    if not do_sample:
        return processed.argmax(dim=-1)
    probs = nn.functional.softmax(processed, dim=-1)
    return torch.multinomial(probs.view(-1, probs.shape[-1]), num_samples=1).view(probs.shape[:-1])


def _generate_output(sequences, row_scores, row_logits, cache, prompt_len, num_steps):
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    def stack(per_row):
        if per_row is None:
            return None
        vocab = next(t for row in per_row for t in row).shape[-1]
        out = []
        for step in range(num_steps):
            out.append(
                torch.stack([row[step] if step < len(row) else row[0].new_zeros(vocab) for row in per_row], dim=0)
            )
        return tuple(out)

    fields = GenerateDecoderOnlyOutput.__dataclass_fields__
    cache_field = "cache" if "cache" in fields else "past_key_values"
    return GenerateDecoderOnlyOutput(
        sequences=sequences, scores=stack(row_scores), logits=stack(row_logits), **{cache_field: cache}
    )


def prepare_generate_kwargs(drafter: nn.Module, target: nn.Module, args: tuple, kwargs: dict) -> dict:
    """Checks run by the `generate` hook before transformers' own, so errors name the DFlash-specific fix."""
    check_drafter_fits_target(drafter, target)
    if kwargs.get("inputs_embeds") is not None:
        raise ValueError(
            "DFlash decoding needs token ids (the drafter embeds its blocks with the target's embedding table); pass "
            "input_ids instead of inputs_embeds."
        )
    inputs = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    if isinstance(inputs, torch.Tensor) and inputs.dim() == 2:
        _check_padding(kwargs.get("attention_mask"), inputs)
    generation_config = kwargs.get("generation_config") or target.generation_config
    num_beams = kwargs.get("num_beams", getattr(generation_config, "num_beams", 1)) or 1
    if num_beams > 1:
        raise ValueError(
            f"Beam search (num_beams={num_beams}) cannot be combined with a DFlash drafter: speculative decoding "
            "verifies one sequence per prompt. Use num_beams=1 (greedy or sampling), or drop assistant_model."
        )
    num_return = kwargs.get("num_return_sequences", getattr(generation_config, "num_return_sequences", 1)) or 1
    if num_return > 1:
        raise ValueError(
            f"num_return_sequences={num_return} cannot be combined with a DFlash drafter. Repeat the prompt in the "
            "batch instead (input_ids.repeat(n, 1)) to get several samples."
        )
    implementation = kwargs.get("cache_implementation", getattr(generation_config, "cache_implementation", None))
    if implementation not in (None, "dynamic", "dynamic_full"):
        raise ValueError(
            f"cache_implementation={implementation!r} cannot be cropped after rejected drafts; DFlash decoding needs a "
            "dynamic cache. Remove `cache_implementation` from the generate() call or generation config."
        )
    if kwargs.get("speculation_type") == "dflash":
        kwargs = dict(kwargs)
        # transformers' own DFlash path expects its built-in drafter class; ours runs through `_assisted_decoding`.
        kwargs.pop("speculation_type")
    return kwargs


def install_generation_hook() -> None:
    """Route `generate(..., assistant_model=<DFlash drafter>)` to DFlash decoding. Idempotent; other assistants and
    prompt lookup keep transformers' own behaviour."""
    from transformers.generation.utils import GenerationMixin

    if getattr(GenerationMixin, "_dflash_hook_installed", False):
        return
    original_generate = GenerationMixin.generate
    original_assisted_decoding = GenerationMixin._assisted_decoding

    @functools.wraps(original_generate)
    def generate(self, *args, **kwargs):
        drafter = kwargs.get("assistant_model")
        if getattr(drafter, "is_dflash_drafter", False):
            kwargs = drafter._dflash_prepare_generate(self, args, kwargs)
        return original_generate(self, *args, **kwargs)

    @functools.wraps(original_assisted_decoding)
    def _assisted_decoding(self, input_ids, *args, assistant_model=None, **kwargs):
        if getattr(assistant_model, "is_dflash_drafter", False):
            kwargs.pop("inputs_tensor", None)
            kwargs.pop("assistant_tokenizer", None)
            kwargs.pop("tokenizer", None)
            return assistant_model._dflash_decoding(self, input_ids, *args, **kwargs)
        return original_assisted_decoding(self, input_ids, *args, assistant_model=assistant_model, **kwargs)

    GenerationMixin.generate = generate
    GenerationMixin._assisted_decoding = _assisted_decoding
    GenerationMixin._dflash_hook_installed = True
    GenerationMixin._dflash_original_methods = {"generate": original_generate, "_assisted_decoding": original_assisted_decoding}
