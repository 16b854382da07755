"""The DFlash decoding loop behind `target.generate(input_ids, assistant_model=drafter)` (part of the carried core).

One step (`dflash_decoding`), for every unfinished row at once:

1. propose: the drafter fills [anchor, MASK x (block_size - 1)] in one forward, conditioned on the target features of
   the positions verified since its last step; copied drafts may replace the head of the block, and the draft-length
   policy may keep only the drafts worth verifying (`propose`);
2. verify: one target forward over [anchor, drafts]; forward hooks on the chosen target layers capture their outputs,
   which become the drafter's context for the next step (no other hidden states are kept);
3. accept: the longest prefix of drafts equal to the target's own choices, plus the target's next ("bonus") token.
   Greedy: choices are the argmax of the processed logits. Sampling: choices are samples of the target's processed
   distribution, so every committed token is distributed exactly as in plain sampling (greedy proposals + "accept on
   equality" is the rejection rule of Leviathan et al. with a one-hot draft distribution);
4. commit: stopping criteria are applied token by token, so an EOS or a stop string inside a block ends the row
   exactly where plain `generate()` would; the caches drop the rejected positions (`DecodingState`).

Ragged acceptance across rows (the cache design): the target's KV cache and the drafter's context cache share one
"slot" layout. Every row appends the same number of slots per step; a row that accepted fewer drafts than the others
leaves masked slots ("holes") in the 2-D attention mask, and slots rejected by every row are cropped. Position ids
are tracked per row, so RoPE sees true positions despite holes and left padding. Finished rows leave the batch
(their cache rows are dropped), so they stop costing work.

Hybrid targets (linear-attention / state-space layers, `state_rollback.py`): their recurrent state cannot be cropped
or have holes, so it is copied before each verification and, after a partly kept block, restored and advanced by
re-feeding the kept tokens; their batched rows commit the same number of tokens per step.

Image / video prompts (vision-language targets such as Qwen3_5ForConditionalGeneration): the media inputs generate()
prepared go to the prefill forward only, so the drafter sees the target's features of the image tokens like any
others. The target's position ids are those generate() prepared for the prompt (Qwen's multimodal RoPE ids, after
an image shifted from the token index by `rope_deltas`), continued as plain decoding continues them: each axis
advances by one per committed token. The state tracks one position per token (the token index, left padding
excluded), which the drafter uses for its own RoPE, and a per-row, per-axis offset maps it to the target's
(`DecodingState.target_positions`).
"""

import contextlib

import torch
from torch import nn

from .candidate_generator import DFlashCandidateGenerator
from .kernels import cpu_kernels, step_clock
from .prefill import grouped_prefill, prefill_groups
from .state_rollback import StateRollback, legacy_qwen3_next_continuation
from .target_model import (
    cache_keyword,
    generate_prepares_position_ids,
    has_sliding_window,
    new_target_cache,
    prompt_inputs,
)
from .verification import accept_lengths, align_continuing_rows, choose_tokens, process_logits, stop_lengths


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
    attention_mask = check_padding(model_kwargs.get("attention_mask"), input_ids)
    _refuse_unsupported(drafter, generation_config, input_ids, attention_mask, synced_gpus, streamer)
    do_sample = generation_config.do_sample
    cache, num_cached = new_target_cache(target, model_kwargs, generation_config, input_ids.shape[0])
    rollback = StateRollback.for_target(target, cache)  # None for attention-only targets
    state = DecodingState(input_ids, attention_mask, generation_config, cache, streamer, rollback)
    if generate_prepares_position_ids():  # transformers >= 5; 4.x made position ids per step, from the mask
        state.follow_target_positions(model_kwargs.get("position_ids"))
    media = prompt_inputs(target, model_kwargs)  # image / video inputs: the prefill's only
    if num_cached:
        state.skip_cached_prompt(num_cached, media)
    generator = DFlashCandidateGenerator(drafter, target, generation_config, logits_processor, input_ids.shape[0])
    forward_keyword = cache_keyword(target)

    def target_forward(ids, position_ids, mask, keep, into=cache, **inputs):
        return target(
            input_ids=ids,
            position_ids=position_ids,
            attention_mask=mask,
            use_cache=True,
            logits_to_keep=keep,
            **{forward_keyword: into},
            **inputs,
        ).logits

    # Sliding-window layers measure their window in cache slots; holes left by ragged acceptance would shrink the
    # window of the rows that accepted less, and a recurrent state cannot have holes. For such targets, batched rows
    # commit the same number of tokens per step.
    align_rows = input_ids.shape[0] > 1 and (has_sliding_window(target) or rollback is not None)
    use_kernels = generator.fast_cpu_linears and input_ids.device.type == "cpu"
    # The row counts of a verification (widths x rows still decoding): the kernels measure them before the prefill.
    # A generator: read only where the kernels are used.
    rows = (width * batch for width in range(1, generator.block_size + 1) for batch in range(1, input_ids.shape[0] + 1))
    kernels = cpu_kernels(target, drafter, rows=rows) if use_kernels else contextlib.nullcontext()
    with kernels, legacy_qwen3_next_continuation(target):  # the latter: transformers 4.57's Qwen3-Next only
        try:
            keep = prefill(
                state,
                input_ids,
                target,
                target_forward,
                generator,
                logits_processor,
                stopping_criteria,
                do_sample,
                media,
            )
            while keep:
                state.drop_finished(keep, generator.cache)
                step_start = step_clock()  # the kernels' own measuring excluded
                drafts, drafted = propose(generator, state, state.num_draft(generator.block_size))  # 1. propose
                verify_start = step_clock()
                candidates = torch.cat([state.anchor[:, None], drafts], dim=1)  # 2. verify
                block_positions = state.open_block(candidates.shape[1])
                target_positions = state.target_positions(block_positions)
                if rollback is not None and candidates.shape[1] > 1:  # one token is always kept: nothing to undo
                    rollback.snapshot()
                raw = target_forward(candidates, target_positions, state.context_mask, candidates.shape[1]).float()
                processed = process_logits(
                    logits_processor, state.sequences, state.active, state.lengths, candidates, raw
                )
                choices = choose_tokens(processed, do_sample)
                accepted = accept_lengths(drafts, choices)  # 3. accept
                budgets = state.budgets()
                num_new = torch.minimum(accepted + 1, torch.tensor(budgets, device=accepted.device))
                num_new, stopped = stop_lengths(
                    stopping_criteria,
                    state.sequences,
                    state.active,
                    state.lengths,
                    choices,
                    num_new,
                    state.eos_token_id,
                )  # the step's one host sync
                if align_rows:
                    num_new = align_continuing_rows(num_new, stopped, budgets)
                keep = state.commit(choices, num_new, stopped, raw, processed)  # 4. commit
                if keep:
                    state.close_block(choices, num_new, keep, block_positions, generator.captured_features(), drafted)
                    if rollback is not None:  # recurrent state: back to before the block, re-feed the kept tokens
                        rollback.settle(target_forward, candidates, target_positions, state.context_mask, num_new, keep)
                elif rollback is not None and state.returns_one_cache():
                    rollback.settle_last(target_forward, candidates, target_positions, num_new[0])
                # The step's cost runs to here: on hybrid targets a partial accept also pays the re-feed, which makes
                # wide blocks dearer there, and the draft-length policy must see that.
                draft_seconds = verify_start - step_start if drafted else None
                generator.record_step(accepted, candidates.shape[1], step_clock() - verify_start, draft_seconds)
        finally:
            generator.close()
    state.trim_cache()
    if streamer is not None:
        streamer.end()
    drafter.last_acceptance_lengths = state.acceptance[0] if len(state.acceptance) == 1 else state.acceptance
    return state.output(generation_config.return_dict_in_generate)


def propose(generator: DFlashCandidateGenerator, state: "DecodingState", num_draft: int):
    """The drafts to verify `[rows, k]` (k = 0: a plain decoding step) and whether the drafter ran for them."""
    policy, lookup = generator.draft_length_policy, generator.ngram_lookup
    copies = None
    if lookup is not None and num_draft > 0:
        copies = lookup.find(state.sequences, state.active, state.lengths, num_draft)
    # Good copies first: skipping the drafter for them leaves the back-off of `wants_draft` untouched.
    drafted = (
        num_draft > 0
        and (copies is None or policy.draft_beats_copies([0.0 if c is None else c.expected for c in copies], num_draft))
        and policy.wants_draft()
    )
    drafts, confidence = state.anchor.new_empty(len(state.active), 0), None
    if drafted:
        drafts, confidence = generator.draft(
            state.anchor, state.next_position, state.context, state.context_positions, state.drafter_mask(), num_draft
        )
        policy.record_drafts(confidence)
    if copies is not None:
        drafts, merged = lookup.merge(copies, drafts, confidence, num_draft)
        confidence = merged if policy.uses_confidence else None
    return (policy.trim(drafts, confidence, paid_draft=drafted) if drafts.shape[1] else drafts), drafted


def prefill(
    state, input_ids, target, target_forward, generator, logits_processor, stopping_criteria, do_sample, media=None
):
    """The whole prompt through the target (the hooks keep the drafter's context features) and its first token.

    `media`: the prompt's image / video inputs (`prompt_inputs`), for this forward only. Returns the rows that
    continue. On CPUs a ragged text batch is prefilled in groups of similar length (`prefill_groups`)."""
    mask = state.context_mask
    plain_positions = state.target_offsets is None  # grouped rows get their positions from their own mask
    groups = prefill_groups(mask, target) if mask is not None and plain_positions and not media else None
    if groups is not None:
        raw, features = grouped_prefill(target_forward, generator, input_ids, mask, groups, state.cache)
    else:
        uncached = input_ids[:, state.num_cached :]
        raw = target_forward(uncached, state.prompt_target_positions, mask, 1, **(media or {}))[:, -1:]
        features = generator.captured_features()
    raw = raw.float()
    processed = logits_processor(input_ids, raw[:, 0].clone())[:, None] if logits_processor else raw
    choices = choose_tokens(processed, do_sample)
    first = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    num_new, stopped = stop_lengths(
        stopping_criteria, state.sequences, state.active, state.lengths, choices, first, state.eos_token_id
    )
    keep = state.commit(choices, num_new, stopped, raw, processed)
    state.anchor, state.context = choices[:, 0], features
    return keep


class DecodingState:
    """Everything that changes while a batch decodes.

    For every ORIGINAL row: `sequences` (committed tokens, left-padded prompt first), `lengths` (how many),
    `acceptance` (tokens committed per target forward) and, when asked for, the scores/logits of each new token.
    For the ACTIVE rows (`active[i]` is the original row of active row i): the `anchor` (last committed token, not yet
    seen by the target) and its position `next_position`; the drafter's pending `context` (target features of the
    positions verified since its last draft) with `context_positions`; and `context_mask`, the validity of every
    target cache slot (shared with the drafter's context cache; None while every slot is valid).

    Positions are token indices (left padding excluded), as the drafter uses them. A target whose generate()
    prepared other position ids for the prompt (multimodal RoPE) gets those for the prompt
    (`prompt_target_positions`) and, for later tokens, the state's positions plus `target_offsets` (`[rows]` or
    `[axes, rows]`; None when the target's positions are the state's).
    """

    def __init__(self, input_ids, attention_mask, generation_config, cache, streamer, rollback=None):
        batch, prompt_len = input_ids.shape
        device = input_ids.device
        pad_token_id = getattr(generation_config, "_pad_token_tensor", None)
        pad_token_id = int(pad_token_id) if pad_token_id is not None else 0
        self.prompt_len, self.max_length = prompt_len, generation_config.max_length
        self.eos_token_id = getattr(generation_config, "_eos_token_tensor", None)
        self.sequences = torch.full((batch, self.max_length), pad_token_id, dtype=input_ids.dtype, device=device)
        self.sequences[:, :prompt_len] = input_ids
        self.lengths = [prompt_len] * batch
        self.acceptance: list[list[int]] = [[] for _ in range(batch)]
        keep_outputs = generation_config.return_dict_in_generate
        self.scores = [[] for _ in range(batch)] if keep_outputs and generation_config.output_scores else None
        self.logits = [[] for _ in range(batch)] if keep_outputs and generation_config.output_logits else None
        self.cache, self.streamer = cache, streamer
        # Crops and row selections go through the rollback on hybrid caches (their recurrent layers cannot crop).
        self.cache_ops = rollback if rollback is not None else cache
        self.active = list(range(batch))
        self.anchor = self.context = None  # set by the prefill
        if attention_mask is not None:
            self.context_positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            self.context_mask = attention_mask.long()
            self.next_position = attention_mask.sum(-1)
        else:
            self.context_positions = torch.arange(prompt_len, device=device).expand(batch, -1)
            self.context_mask = None
            self.next_position = torch.full((batch,), prompt_len, device=device)
        self.prompt_target_positions, self.target_offsets = self.context_positions, None
        self.num_cached = 0  # prompt tokens the target's cache held before the call (`skip_cached_prompt`)

    def follow_target_positions(self, prepared: torch.Tensor | None) -> None:
        """Use the prompt position ids generate() prepared (`[batch, prompt_len]` or `[axes, batch, prompt_len]`)
        and continue them as plain decoding does: every axis advances by one per committed token, i.e. keeps its
        offset from the state's position at the prompt's last token (never padding: left padding only)."""
        if prepared is None:
            return
        batch, prompt_len = self.context_positions.shape
        if prepared.dim() not in (2, 3) or prepared.shape[-1] != prompt_len or prepared.shape[-2] not in (1, batch):
            raise ValueError(
                f"position_ids has shape {tuple(prepared.shape)}, which does not fit input_ids of shape "
                f"{(batch, prompt_len)}; pass position ids of the prompt's length, or none (generate() builds them)."
            )
        prepared = prepared.to(self.context_positions.device).expand(*prepared.shape[:-2], batch, prompt_len)
        if prepared.dim() == 2 and torch.equal(prepared, self.context_positions):
            return  # the target's positions are the state's (text targets): nothing to map
        self.prompt_target_positions = prepared
        self.target_offsets = prepared[..., -1] - self.context_positions[:, -1]

    def skip_cached_prompt(self, num_cached: int, media: dict | None) -> None:
        """The target's cache already holds the prompt's first `num_cached` tokens (one prompt, no padding): the
        prefill reads only the rest, whose features are the drafter's first context (so its first drafts may be
        accepted less often; what is verified does not change)."""
        if num_cached >= self.prompt_len:
            raise ValueError(
                f"The cache passed to generate() already holds {num_cached} tokens but the prompt has "
                f"{self.prompt_len}: input_ids must be the whole conversation so far, ending with at least one token "
                "the cache has not seen."
            )
        if media:
            raise ValueError(
                "DFlash decoding cannot continue from a pre-filled cache with image or video inputs: pass the full "
                "prompt and its media without `past_key_values`/`cache`."
            )
        self.num_cached = num_cached
        self.context_positions = self.context_positions[:, num_cached:]
        self.prompt_target_positions = self.prompt_target_positions[..., num_cached:]

    def drafter_mask(self) -> torch.Tensor | None:
        """`context_mask` over the drafter's context cache: the target's slots but those of a cached prompt prefix,
        which the target read before this call, so that the drafter never had their features."""
        return None if self.context_mask is None else self.context_mask[:, self.num_cached :]

    def returns_one_cache(self) -> bool:
        """Whether the cache is one prompt's, without holes or padding: the one `trim_cache` (or, for a hybrid target,
        `StateRollback.settle_last`) leaves as plain decoding does. A batch's cache keeps its holes."""
        return len(self.sequences) == 1 and self.context_mask is None

    def trim_cache(self) -> None:
        """At the end, leave a one-prompt cache as plain decoding leaves it: every committed token but the last, which
        no forward has read yet (rejected drafts of the last block, e.g. after an EOS, are dropped), so that it can be
        passed to the next generate() call of a conversation. A hybrid target's last block was settled in the loop."""
        if not self.returns_one_cache() or self.cache_ops is not self.cache:
            return
        excess = self.cache.get_seq_length() - (self.lengths[0] - 1)
        if excess > 0:
            self.cache.crop(-excess)

    def target_positions(self, positions: torch.LongTensor) -> torch.LongTensor:
        """The target's position ids of the state's positions `[rows, n]` (of tokens after the prompt)."""
        return positions if self.target_offsets is None else positions + self.target_offsets[..., None]

    def budgets(self) -> list[int]:
        """Tokens each active row may still commit."""
        return [self.max_length - self.lengths[r] for r in self.active]

    def num_draft(self, block_size: int) -> int:
        """Drafts to propose this step: a block's worth, fewer when every row's budget is nearly spent."""
        return min(block_size - 1, max(self.budgets()) - 1)

    def drop_finished(self, keep: list[int], drafter_cache) -> None:
        """Only the active rows `keep` go on: the others leave the batch and both caches."""
        if len(keep) == len(self.active):
            return
        index = torch.tensor(keep, device=self.anchor.device)
        self.active = [self.active[i] for i in keep]
        self.cache_ops.batch_select_indices(index)
        drafter_cache.batch_select_indices(index)
        self.anchor, self.next_position = self.anchor[index], self.next_position[index]
        self.context, self.context_positions = self.context[index], self.context_positions[index]
        if self.target_offsets is not None:
            self.target_offsets = self.target_offsets[..., index]
        if self.context_mask is not None:
            self.context_mask = self.context_mask[index]

    def open_block(self, width: int) -> torch.LongTensor:
        """Positions `[rows, width]` of the block about to be verified; its slots join the mask as valid."""
        if self.context_mask is not None:
            self.context_mask = torch.cat([self.context_mask, self.context_mask.new_ones(len(self.active), width)], 1)
        return self.next_position[:, None] + torch.arange(width, device=self.next_position.device)

    def commit(self, choices, num_new: list[int], stopped: list[bool], raw, processed) -> list[int]:
        """Write each active row's first `num_new` choices; return the active rows that continue."""
        continuing = []
        for i, (r, k) in enumerate(zip(self.active, num_new)):
            self.sequences[r, self.lengths[r] : self.lengths[r] + k] = choices[i, :k]
            self.lengths[r] += k
            self.acceptance[r].append(k)
            if self.scores is not None:
                self.scores[r].extend(processed[i, :k].unbind(0))
            if self.logits is not None:
                self.logits[r].extend(raw[i, :k].unbind(0))
            if not stopped[i] and self.lengths[r] < self.max_length:
                continuing.append(i)
        if self.streamer is not None:
            self.streamer.put(choices[0, : num_new[0]].cpu())
        return continuing

    def close_block(self, choices, num_new: list[int], keep: list[int], block_positions, features, drafted: bool):
        """After a commit: drop the slots no continuing row verified, mark the holes of rows that accepted less, hand
        the verified positions' features to the drafter's next context, and move every anchor to its bonus token."""
        width = block_positions.shape[1]
        kept_slots = max(num_new[i] for i in keep)  # anchor + accepted drafts of the longest continuing row
        if width > kept_slots:
            self.cache_ops.crop(-(width - kept_slots))
        device = block_positions.device
        if self.context_mask is not None or min(num_new) < kept_slots:  # some row left holes: track them
            num_kept = torch.tensor(num_new, device=device).clamp(max=kept_slots)
            verified = torch.arange(kept_slots, device=device)[None] < num_kept[:, None]
            if self.context_mask is None:
                earlier = self.cache.get_seq_length() - kept_slots
                self.context_mask = torch.ones(len(self.active), earlier, dtype=torch.long, device=device)
            else:
                self.context_mask = self.context_mask[:, : self.context_mask.shape[1] - width]
            self.context_mask = torch.cat([self.context_mask, verified.long()], dim=1)
        new_context, new_positions = features[:, :kept_slots], block_positions[:, :kept_slots]
        if drafted:  # the drafter has read its earlier context: only the new positions are pending
            self.context, self.context_positions = new_context, new_positions
        else:
            self.context = torch.cat([self.context, new_context], dim=1)
            self.context_positions = torch.cat([self.context_positions, new_positions], dim=1)
        index = torch.tensor(num_new, device=device) - 1
        self.anchor = choices.gather(1, index[:, None])[:, 0]
        self.next_position = self.next_position + index + 1

    def output(self, return_dict: bool):
        """What plain `generate()` returns: the sequences, or a `GenerateDecoderOnlyOutput` with scores/logits."""
        sequences = self.sequences[:, : max(self.lengths)]
        if not return_dict:
            return sequences
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        num_steps = max(self.lengths) - self.prompt_len

        def stack(per_row):
            if per_row is None:
                return None
            vocab = next(t for row in per_row for t in row).shape[-1]
            steps = range(num_steps)
            return tuple(torch.stack([r[s] if s < len(r) else r[0].new_zeros(vocab) for r in per_row]) for s in steps)

        cache_field = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"
        return GenerateDecoderOnlyOutput(
            sequences=sequences, scores=stack(self.scores), logits=stack(self.logits), **{cache_field: self.cache}
        )


def _refuse_unsupported(drafter, generation_config, input_ids, attention_mask, synced_gpus, streamer) -> None:
    if synced_gpus:
        raise ValueError("DFlash decoding does not support synced_gpus (DeepSpeed ZeRO-3 / FSDP generation).")
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError(
            "output_attentions / output_hidden_states are not available with DFlash decoding (it keeps only the "
            "drafter's target layers). Drop them, or generate without assistant_model to inspect the target."
        )
    if streamer is not None and input_ids.shape[0] > 1:
        raise ValueError("A streamer needs a batch of one prompt; DFlash rows advance by different amounts per step.")
    max_positions = drafter.config.max_position_embeddings
    longest = int(attention_mask.sum(-1).max()) if attention_mask is not None else input_ids.shape[1]
    if longest >= max_positions:
        raise ValueError(
            f"A prompt has {longest} tokens but the drafter handles at most {max_positions} positions "
            "(max_position_embeddings). Shorten the prompt or generate without the drafter."
        )


def check_padding(attention_mask: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor | None:
    """The attention mask as bools when some row is left-padded, None when there is no padding; a ValueError for a
    mask that does not fit the ids, right padding or an empty prompt."""
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
