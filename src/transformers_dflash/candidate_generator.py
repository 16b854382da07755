"""`DFlashCandidateGenerator`: drafts a block per step from the target's own hidden states (part of the carried core)."""

import logging
import weakref

import torch
from torch import nn
from torch.nn import functional as F
from transformers.generation.candidate_generator import CandidateGenerator

from .draft_length import AutoDraftLength, draft_length_policy
from .kernels import bfloat16_is_fast, skinny_linear
from .modeling_dflash import DFlashDrafterCache
from .ngram_lookup import ngram_lookup_for
from .target_model import feature_modules, keep_outputs, remove_hooks

logger = logging.getLogger(__name__)


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

    def __init__(
        self,
        drafter: nn.Module,
        target: nn.Module,
        generation_config=None,
        logits_processor=None,
        batch_size: int = 1,
        **kwargs,
    ):
        self.drafter = drafter
        self.config = drafter.config
        self.block_size = self.config.block_size
        self.embed_tokens = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.fast_cpu_linears = getattr(drafter, "fast_cpu_linears", True)
        self.head = DraftHead(drafter, self.lm_head, skinny_linear if self.fast_cpu_linears else F.linear)
        self.max_length = getattr(generation_config, "max_length", None)
        self.logits_processor = logits_processor
        self.cache = DFlashDrafterCache(self.config.num_hidden_layers)
        device = self.embed_tokens.weight.device  # where verification runs: its costs decide the defaults
        self.draft_length_policy = draft_length_policy(getattr(drafter, "draft_length", None), device)
        self.ngram_lookup = ngram_lookup_for(getattr(drafter, "ngram_lookup", None), self.block_size, device)
        self._resume(getattr(drafter, "draft_length_memory", None), device, batch_size)
        drafter_param = next(drafter.parameters())
        self.drafter_device, self.drafter_dtype = drafter_param.device, drafter_param.dtype
        _warn_slow_cpu_dtype(self.drafter_dtype, self.head.weight.dtype, self.drafter_device)
        self.num_captured_valid = 0

        # Forward hooks keep the chosen layers' outputs (the target's hidden_states[i + 1]) at every target forward.
        self._captured: list[torch.Tensor | None] = [None] * len(self.config.target_layer_ids)
        handles = keep_outputs(feature_modules(target, self.config.target_layer_ids), self._captured)
        # The hooks close over the list, not over self, so they go away as soon as the generator does.
        self._finalizer = weakref.finalize(self, remove_hooks, handles)
        self.drafter.last_acceptance_lengths = []

    def _resume(self, memory: dict | None, device: torch.device, batch_size: int) -> None:
        """Take over what "auto" and the copied drafts measured in this drafter's earlier generate() calls (step
        and draft costs, copy acceptance rates; the memory is `drafter.draft_length_memory`), kept per device, thread
        count and batch size, since step costs depend on them."""
        if memory is None:
            return
        if isinstance(self.draft_length_policy, AutoDraftLength):
            key = ("auto", device.type, torch.get_num_threads(), batch_size)
            self.draft_length_policy = memory.setdefault(key, self.draft_length_policy)
            self.draft_length_policy.start_call()
        if self.ngram_lookup is not None:
            key = ("copies", self.ngram_lookup.max_ngram_size, self.block_size)
            self.ngram_lookup = memory.setdefault(key, self.ngram_lookup)
            self.ngram_lookup.start_call()

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
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Propose `num_draft` (<= block_size - 1) tokens after each row's anchor, in one drafter forward.

        Returns the drafts `[batch, num_draft]` and, when the draft-length policy uses it, the probability the
        drafter gives each of its own proposals (`[batch, num_draft]`, else None).

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
        drafts, logits = self.head(hidden[:, 1 : 1 + num_draft])
        confidence = None
        if self.draft_length_policy.uses_confidence:
            # Probability the drafter gives its own proposal: a cheap estimate of each draft's chance of acceptance.
            confidence = torch.softmax(logits.float(), dim=-1).amax(dim=-1).to(anchor_ids.device)
        return drafts.to(anchor_ids.device), confidence

    def record_step(self, accepted: torch.LongTensor, width: int, seconds: float, draft_seconds: float | None):
        """After a verification of `width` tokens that took `seconds` (after a draft of `draft_seconds`, None when the
        drafter did not run): `accepted[i]` drafts of row i were accepted. Feeds the policy and the lookup."""
        if self.ngram_lookup is not None:
            self.ngram_lookup.record(accepted.tolist(), width - 1)
        self.draft_length_policy.record(width, seconds, draft_seconds, accepted)

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
        drafts, _ = self.draft(input_ids[:, -1], anchor_position, features, positions, num_draft=num_draft)
        return torch.cat([input_ids, drafts.to(input_ids.device)], dim=1), None

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        self.drafter.last_acceptance_lengths.append(int(num_matches) + 1)


class DraftHead:
    """The drafter's proposals from its output hidden states: the target's LM head restricted to the draft
    vocabulary (its rows sliced once), argmax, mapped back to target token ids. The mask token is never proposed."""

    def __init__(self, drafter: nn.Module, lm_head: nn.Module, linear=F.linear):
        self.weight, self.bias = drafter.draft_head(lm_head)
        self.linear = linear
        self.vocab_ids, self.mask_index = drafter.draft_vocab_ids, drafter.config.mask_token_id
        if self.vocab_ids is not None:
            self.vocab_ids = self.vocab_ids.to(self.weight.device)
            self.mask_index = (self.vocab_ids == drafter.config.mask_token_id).nonzero().flatten()

    def __call__(self, hidden: torch.Tensor) -> tuple[torch.LongTensor, torch.Tensor]:
        """Proposals `[...]` (target token ids) and logits `[..., draft vocab]` of drafter outputs `[..., hidden]`."""
        # Rows flattened to one matrix: a strided 3-D input (the draft slots of a block) sends F.linear to a batched
        # product with the weight broadcast, several times slower on CPUs.
        rows = hidden.to(self.weight.device, self.weight.dtype).reshape(-1, hidden.shape[-1])
        logits = self.linear(rows, self.weight, self.bias).view(*hidden.shape[:-1], -1)
        # The mask token is the drafter's input placeholder; an (untrained) drafter tends to echo it back.
        logits[..., self.mask_index] = torch.finfo(logits.dtype).min
        drafts = logits.argmax(dim=-1)
        return (drafts if self.vocab_ids is None else self.vocab_ids[drafts]), logits


_warned_dtypes: set = set()


def _warn_slow_cpu_dtype(drafter_dtype: torch.dtype, target_dtype: torch.dtype, device: torch.device) -> None:
    """Warn (once per dtype pair) when a half-precision drafter runs on CPU next to a float32 target: CPU bfloat16 /
    float16 matrix products are slower than float32 ones on most CPUs, so the drafter costs more than it should.
    Not for bfloat16 on a CPU with bfloat16 instructions (AMX, AVX512-BF16), where its products are the faster ones."""
    key = (drafter_dtype, target_dtype)
    if device.type != "cpu" or target_dtype != torch.float32 or key in _warned_dtypes:
        return
    if drafter_dtype != torch.float16 and (drafter_dtype != torch.bfloat16 or bfloat16_is_fast(device)):
        return
    _warned_dtypes.add(key)
    logger.warning(
        "The drafter's weights are %s and the target's float32, on CPU, where half-precision matrix products are "
        "usually slower than float32 ones, so drafting costs more than it needs to. Load the drafter with the "
        "target's dtype, e.g. AutoModel.from_pretrained(path, trust_remote_code=True, dtype=target.dtype).",
        str(drafter_dtype).replace("torch.", ""),
    )
