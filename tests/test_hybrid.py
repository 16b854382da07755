"""Hybrid targets (linear-attention / state-space layers next to attention): the rollback of their recurrent and
convolution state (state_rollback.py).

- the claim the design rests on: for every accepted model type, a multi-token forward from a cache continues the
  cached state exactly (on transformers 4.57 only with `legacy_qwen3_next_continuation`, whose need is shown too);
- after every step the cached state equals what plain decoding of the committed tokens leaves;
- batches: rows finishing at different steps leave the batch, left padding, rows equal plain batched generate();
- sampling is distributed as the target's (chi-square, helpers of tests/test_generation_sampling.py);
- what cannot be rolled back is refused with an error that names the state;
- Qwen3.5 as a vision-language model: text, image and video prompts (one row and left-padded batches, greedy and
  sampled) equal plain generate(); LLaVA image prompts too (transformers 5.x); an image prompt for a text-only
  target, or one DFlash cannot continue, is refused.
"""

import contextlib

import pytest
import torch
from conftest import PAD, VOCAB, make_drafter, make_target
from families import FAMILIES, HYBRID, MAJOR, TINY_DECODER, available, left_pad, make_family_target
from test_generation_sampling import NEW, TEMPERATURE, TOP_K, _chi_square, _critical_value, _exact_distribution
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

from transformers_dflash import DFlashCandidateGenerator, decoding, state_rollback
from transformers_dflash.state_rollback import STATE_CONTINUING_MODEL_TYPES, StateRollback, check_state_rollback

pytestmark = pytest.mark.usefixtures("one_thread")

SUPPORTED = [n for n in HYBRID if available(n) and FAMILIES[n][0] in STATE_CONTINUING_MODEL_TYPES[MAJOR]]
MAIN = ["qwen3_5", "qwen3_next"] if MAJOR >= 5 else ["qwen3_next"]


def _cache_keyword(target):
    from transformers_dflash.target_model import cache_keyword

    return cache_keyword(target)


def _state_tensors(cache):
    rollback = StateRollback(cache)
    return [container[key].clone() for container, key in rollback._state_slots()]


def _drafter(target, block_size=4, seed=1):
    drafter = make_drafter(target, block_size=block_size, seed=seed)
    drafter.draft_length, drafter.ngram_lookup = "full", 0
    return drafter


@pytest.mark.parametrize("name", SUPPORTED)
def test_multi_token_forward_continues_the_cached_state(name):
    """Verification feeds a block in one forward after the cached prefix: it must give the full forward's logits."""
    target = make_family_target(name)
    seq = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    cache = state_rollback.new_hybrid_cache(target)
    keyword = _cache_keyword(target)
    with torch.no_grad(), state_rollback.legacy_qwen3_next_continuation(target):
        target(input_ids=seq[:, :7], use_cache=True, **{keyword: cache})
        continued = target(input_ids=seq[:, 7:], use_cache=True, **{keyword: cache}).logits
        full = target(input_ids=seq).logits[:, 7:]
    assert (continued - full).abs().max() < 1e-4  # float32 inside the linear-attention kernels


@pytest.mark.skipif(MAJOR >= 5, reason="transformers 4.57's Qwen3-Next only")
def test_legacy_qwen3_next_needs_the_continuation_patch(oracle, monkeypatch):
    """Without `legacy_qwen3_next_continuation`, 4.57's Qwen3-Next verifies blocks from a zero state: wrong output."""
    target = make_family_target("qwen3_next")
    prompt = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
    expected = target.generate(prompt, max_new_tokens=20, do_sample=False)
    oracle([expected[0]], corrupt=0.3)
    monkeypatch.setattr(decoding, "legacy_qwen3_next_continuation", lambda target: contextlib.nullcontext())
    out = target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=_drafter(target))
    assert not torch.equal(out, expected)


@pytest.mark.parametrize("name", MAIN)
def test_state_before_each_verification_equals_plain_decoding(name, oracle, monkeypatch):
    """Before every verification the recurrent and conv states equal those of a fresh forward over the committed
    tokens (all but the anchor): each partial accept was rolled back exactly."""
    target = make_family_target(name)
    prompt = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(2))
    expected = target.generate(prompt, max_new_tokens=24, do_sample=False)
    oracle([expected[0]], corrupt=0.5, seed=3)
    seen = []
    snapshot = StateRollback.snapshot

    def recording_snapshot(self):
        seen.append((self.cache.get_seq_length(), _state_tensors(self.cache)))
        return snapshot(self)

    monkeypatch.setattr(StateRollback, "snapshot", recording_snapshot)
    drafter = _drafter(target, block_size=5)
    out = target.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=drafter)
    assert torch.equal(out, expected)
    assert any(1 < n < 5 for n in drafter.last_acceptance_lengths)  # partial accepts happened
    keyword = _cache_keyword(target)
    for slots, states in seen:
        fresh = state_rollback.new_hybrid_cache(target)
        with torch.no_grad():
            target(input_ids=out[:, :slots], use_cache=True, **{keyword: fresh})
        reference = _state_tensors(fresh)
        assert len(reference) == len(states)
        for got, want in zip(states, reference):
            assert torch.allclose(got.double(), want.double(), atol=1e-5), f"state differs after {slots} tokens"


@pytest.mark.parametrize("name", MAIN)
def test_batch_rows_leave_at_different_steps(name, oracle):
    """EOS ends rows at different steps (their state rows leave the batch); left padding enters the recurrent state
    as zero inputs. Rows equal plain batched generate() and, here, single-row generate() too."""
    target = make_family_target(name)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g) for n in (2, 11, 6, 8)]
    free = [target.generate(p[None], max_new_tokens=20, do_sample=False)[0, len(p) :] for p in prompts]
    eos = sorted({int(free[0][4]), int(free[2][9])})  # row 0 and row 2 stop early (others may too)
    kwargs = dict(max_new_tokens=20, do_sample=False, eos_token_id=eos, pad_token_id=PAD)
    ids, mask = left_pad(prompts)
    expected = target.generate(ids, attention_mask=mask, **kwargs)
    singles = [target.generate(p[None], **kwargs)[0] for p in prompts]
    for row, single in enumerate(singles):  # plain transformers: padded batched prefill of a hybrid behaves
        start = ids.shape[1] - len(prompts[row])
        assert torch.equal(expected[row, start : start + len(single)], single)
    oracle(singles, corrupt=0.3, seed=6)
    drafter = _drafter(target)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, **kwargs)
    assert torch.equal(out, expected)
    lengths = [sum(row) for row in drafter.last_acceptance_lengths]
    assert len(set(lengths)) > 1  # rows really finished at different steps


def test_hybrid_targets_keep_the_padded_prefill():
    from transformers_dflash.prefill import prefill_groups

    lengths = [53, 60, 64, 90, 68, 106, 65, 54, 56, 59, 210, 286, 54, 69, 58, 49]  # grouped for attention targets
    width = max(lengths)
    mask = (torch.arange(width)[None] >= torch.tensor([width - n for n in lengths])[:, None]).long()
    assert prefill_groups(mask, make_family_target("qwen3")) is not None
    assert prefill_groups(mask, make_family_target("qwen3_next")) is None


# Fewer samples than tests/test_generation_sampling.py (4000): transformers' PyTorch delta-rule kernel pads every
# multi-token forward to a 64-token chunk, so hybrid rows cost far more than attention rows. Batches of 250 rows keep
# its intermediate tensors small.
SAMPLES, BATCH = 2000, 250


def _check_sampling(target, drafter, prompt, probs, monkeypatch, mode_proposals=True, media=lambda rows, length: {}):
    """Sample SAMPLES continuations of `prompt` with DFlash and chi-square them against the exact `probs`.
    `mode_proposals`: the drafter proposes the target's most likely continuation of [prompt, anchor], so drafts are
    accepted often and rejected often. `media(rows, length)`: the extra inputs of `rows` copies of the prompt whose
    token ids reach `length` (multimodal prompts)."""
    if mode_proposals:
        original = DFlashCandidateGenerator.draft

        def draft(self, anchor_ids, anchor_position_ids, *args, **kwargs):
            drafts, confidence = original(self, anchor_ids, anchor_position_ids, *args, **kwargs)
            prefix = torch.cat([prompt.repeat(anchor_ids.shape[0], 1), anchor_ids[:, None]], dim=1)
            for k in range(drafts.shape[1]):
                logits = target(input_ids=prefix, **media(prefix.shape[0], prefix.shape[1])).logits
                drafts[:, k] = logits[:, -1].argmax(-1)
                prefix = torch.cat([prefix, drafts[:, k : k + 1]], dim=1)
            return drafts, confidence

        monkeypatch.setattr(DFlashCandidateGenerator, "draft", draft)
    torch.manual_seed(0)
    counts, accepted = {}, []
    for _ in range(SAMPLES // BATCH):
        out = target.generate(
            prompt.repeat(BATCH, 1),
            do_sample=True,
            temperature=TEMPERATURE,
            top_k=TOP_K,
            max_new_tokens=NEW,
            pad_token_id=0,
            assistant_model=drafter,
            **media(BATCH, prompt.shape[1]),
        )
        for row in out[:, prompt.shape[1] :].tolist():
            counts[tuple(row)] = counts.get(tuple(row), 0) + 1
        accepted += [n for row in drafter.last_acceptance_lengths for n in row[1:]]
    stat, df, outside = _chi_square(counts, probs, SAMPLES)
    assert outside == 0, "DFlash sampled a sequence the target gives probability 0"
    assert stat < _critical_value(df), f"chi2={stat:.1f} over {df} df: DFlash sampling is not the target's"
    if mode_proposals:
        assert max(accepted) > 1 and min(accepted) == 1  # drafts were accepted, and rejected


@pytest.mark.parametrize("name, proposals", [(MAIN[0], "mode"), (MAIN[-1], "untrained")])
def test_sampling_matches_the_target_distribution(name, proposals, monkeypatch):
    target = make_family_target(name, dtype=torch.float32, vocab_size=6, seed=3, scale=2.0)
    prompt = torch.tensor([[1, 4, 3]])
    probs = _exact_distribution(target, prompt)
    _check_sampling(target, _drafter(target), prompt, probs, monkeypatch, mode_proposals=proposals == "mode")


@pytest.mark.skipif(MAJOR < 5, reason="Bamba's cache is the unified one of transformers >= 5")
def test_a_mamba_target_that_does_not_continue_its_state_is_refused():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "bamba",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_indices=[1],
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_n_groups=1,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=16,
    )
    target = AutoModelForCausalLM.from_config(config).eval()
    drafter = make_drafter(target)
    with pytest.raises(ValueError, match="Mamba recurrent and convolution state.*several new tokens"):
        target.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, assistant_model=drafter)


@pytest.mark.skipif(MAJOR < 5, reason="cache layer classes exist in transformers >= 5")
def test_a_cache_layer_that_cannot_roll_back_is_refused(monkeypatch):
    from transformers import cache_utils

    class RecordingLinearLayer(cache_utils.LinearAttentionLayer):
        """A linear-attention cache layer of another kind (say, one that keeps per-token states on a device)."""

    monkeypatch.setitem(cache_utils.DYNAMIC_LAYER_TYPE_MAPPING, "linear_attention", RecordingLinearLayer)
    target = make_family_target("qwen3_5")
    drafter = make_drafter(target)
    with pytest.raises(ValueError, match="Layer 0 of Qwen3_5ForCausalLM's cache is a RecordingLinearLayer"):
        target.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, assistant_model=drafter)


def test_an_unchecked_hybrid_model_type_is_refused(monkeypatch):
    name = MAIN[0]
    target = make_family_target(name)
    model_type = FAMILIES[name][0]
    monkeypatch.setitem(STATE_CONTINUING_MODEL_TYPES, MAJOR, STATE_CONTINUING_MODEL_TYPES[MAJOR] - {model_type})
    with pytest.raises(ValueError, match="recurrent"):
        check_state_rollback(target)
    with pytest.raises(ValueError, match="recurrent"):
        target.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, assistant_model=make_drafter(target))


def test_a_static_cache_is_refused_for_hybrids():
    target = make_family_target(MAIN[0])
    with pytest.raises(ValueError, match="cache_implementation='static' cannot be cropped"):
        target.generate(
            torch.tensor([[5, 6, 7]]),
            max_new_tokens=4,
            assistant_model=make_drafter(target),
            cache_implementation="static",
        )


def test_the_stateful_flag_is_restored_after_generate():
    target = make_family_target(MAIN[0])
    target.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, assistant_model=_drafter(target))
    assert target._is_stateful and "_is_stateful" not in target.__dict__
    with pytest.raises(ValueError, match="stateful"):  # transformers' own refusal for other assistants stays
        target.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, assistant_model=make_family_target("qwen3"))


# --- Qwen3.5 as a vision-language model, and the released Qwen3.6-27B-DFlash layout ---------------------------------


IMAGE, VIDEO, VISION_START, VISION_END = 90, 91, 92, 93  # the token ids of `_qwen3_5_vl`
PATCH_FEATURES = 3 * 1 * 4 * 4  # channels x temporal_patch_size x patch_size x patch_size


def _qwen3_5_vl(dtype=torch.float64, scale=5.0):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = dict(
        FAMILIES["qwen3_5"][1],
        vocab_size=VOCAB,
        **TINY_DECODER,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=PAD,
    )
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=32,
        patch_size=4,
        temporal_patch_size=1,
        spatial_merge_size=1,
    )
    config = Qwen3_5Config(
        text_config=text,
        vision_config=vision,
        image_token_id=90,
        video_token_id=91,
        vision_start_token_id=92,
        vision_end_token_id=93,
    )
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(config).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(scale)
    return model


def _vision_prompts(rows, modality="image", seed=0, dtype=torch.float64):
    """Prompts for `_qwen3_5_vl` as its processor lays them out: each row is (text before, grid (t, h, w) or None,
    text after); an image is [vision_start, image x h*w, vision_end] (merge size 1), a video one such group per frame.
    Returns left-padded ids, their mask (None for one row) and the media inputs of generate()."""
    g = torch.Generator().manual_seed(seed)
    prompts, patches, grids = [], [], []
    for before, grid, after in rows:
        media = []
        if grid is not None:
            t, h, w = grid
            token = IMAGE if modality == "image" else VIDEO
            media = ([VISION_START] + [token] * (h * w) + [VISION_END]) * t
            patches.append(torch.randn(t * h * w, PATCH_FEATURES, generator=g).to(dtype))
            grids.append(list(grid))
        prompts.append(torch.tensor(before + media + after))
    ids, mask = left_pad(prompts)
    types = torch.where(ids == IMAGE, 1, torch.where(ids == VIDEO, 2, 0)) * mask
    prefix = "pixel_values" if modality == "image" else "pixel_values_videos"
    inputs = {prefix: torch.cat(patches), f"{modality}_grid_thw": torch.tensor(grids), "mm_token_type_ids": types}
    return ids, (mask if len(rows) > 1 else None), inputs


@pytest.mark.skipif(MAJOR < 5, reason="Qwen3.5 exists in transformers >= 5 only")
def test_qwen3_5_vision_language_model_with_text_prompts(oracle):
    target = _qwen3_5_vl()
    drafter = _drafter(target)
    prompt = torch.randint(3, 80, (1, 7), generator=torch.Generator().manual_seed(7))
    expected = target.generate(prompt, max_new_tokens=20, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=drafter), expected)
    oracle([expected[0]], corrupt=0.3)
    assert torch.equal(target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=drafter), expected)
    assert any(n > 1 for n in drafter.last_acceptance_lengths)


@pytest.mark.skipif(MAJOR < 5, reason="Qwen3.5 exists in transformers >= 5 only")
@pytest.mark.parametrize("modality, grid", [("image", (1, 2, 4)), ("video", (2, 2, 2))])
def test_qwen3_5_image_and_video_prompts(modality, grid, oracle, monkeypatch):
    """The media inputs reach the target's prefill, and every later forward gets the multimodal RoPE positions plain
    generate() gives (shifted by rope_deltas after the image): equal output with a random drafter and with partial
    acceptance. With the token-index positions the drafter uses instead, the output differs."""
    target = _qwen3_5_vl()
    ids, _, inputs = _vision_prompts([([5, 6, 40], grid, [41, 7, 8, 9])], modality)
    kwargs = dict(max_new_tokens=20, do_sample=False, **inputs)
    expected = target.generate(ids, **kwargs)
    assert int(target.model.rope_deltas) < 0  # later text positions are not the token indices
    other_pixels = {k: v + 1 if k.startswith("pixel") else v for k, v in inputs.items()}
    assert not torch.equal(target.generate(ids, max_new_tokens=20, do_sample=False, **other_pixels), expected)
    drafter = _drafter(target)
    assert torch.equal(target.generate(ids, assistant_model=drafter, **kwargs), expected)
    oracle([expected[0]], corrupt=0.3)
    assert torch.equal(target.generate(ids, assistant_model=drafter, **kwargs), expected)
    assert any(n > 1 for n in drafter.last_acceptance_lengths)
    monkeypatch.setattr(decoding.DecodingState, "follow_target_positions", lambda self, prepared: None)
    assert not torch.equal(target.generate(ids, assistant_model=drafter, **kwargs), expected)


@pytest.mark.skipif(MAJOR < 5, reason="Qwen3.5 exists in transformers >= 5 only")
def test_qwen3_5_left_padded_batch_with_images(oracle):
    """Rows with images of different sizes and a text-only row, left-padded; EOS ends rows at different steps (their
    position offsets leave the batch with them). Rows equal plain batched generate()."""
    target = _qwen3_5_vl()
    rows = [([5], (1, 2, 4), [7, 8]), ([11, 12, 13, 14], (1, 2, 2), [20, 21, 22, 23, 24]), ([30, 31, 32], None, [])]
    ids, mask, inputs = _vision_prompts(rows)
    free = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=PAD, **inputs)
    eos = sorted({int(free[0, ids.shape[1] + 4]), int(free[2, ids.shape[1] + 11])})
    kwargs = dict(max_new_tokens=20, do_sample=False, eos_token_id=eos, pad_token_id=PAD, attention_mask=mask)
    expected = target.generate(ids, **kwargs, **inputs)
    drafter = _drafter(target)
    assert torch.equal(target.generate(ids, assistant_model=drafter, **kwargs, **inputs), expected)
    oracle([row[int(m.argmax()) :] for row, m in zip(expected, mask)], corrupt=0.3, seed=6)
    assert torch.equal(target.generate(ids, assistant_model=drafter, **kwargs, **inputs), expected)
    assert any(n > 1 for row in drafter.last_acceptance_lengths for n in row)
    assert len({sum(row) for row in drafter.last_acceptance_lengths}) > 1  # rows finished at different steps


@torch.no_grad()
def _exact_distribution_with_media(target, ids, inputs):
    """`_exact_distribution` for a prompt with media: full forwards (the model computes its own multimodal RoPE
    positions from the token types), over the tokens top-k leaves."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(TEMPERATURE), TopKLogitsWarper(TOP_K)])
    probs = {}

    def walk(prefix, p):
        if len(prefix) == ids.shape[1] + NEW:
            probs[tuple(prefix[ids.shape[1] :])] = p
            return
        prefix_ids = torch.tensor([prefix])
        types = torch.nn.functional.pad(inputs["mm_token_type_ids"], (0, len(prefix) - ids.shape[1]))
        logits = target(input_ids=prefix_ids, **dict(inputs, mm_token_type_ids=types)).logits[:, -1].float()
        step = torch.softmax(warpers(prefix_ids, logits), dim=-1)[0]
        for token in step.nonzero()[:, 0].tolist():
            walk(prefix + [token], p * float(step[token]))

    walk(ids[0].tolist(), 1.0)
    return probs


@pytest.mark.skipif(MAJOR < 5, reason="Qwen3.5 exists in transformers >= 5 only")
def test_qwen3_5_sampling_with_an_image_matches_the_target_distribution(monkeypatch):
    """Sampling after an image prompt is distributed as the target's (the image and its RoPE positions included);
    proposals are the target's mode continuation, so drafts are often accepted and often rejected."""
    target = _qwen3_5_vl(dtype=torch.float32, scale=2.5)
    ids, _, inputs = _vision_prompts([([4], (1, 2, 2), [3])], dtype=torch.float32)
    probs = _exact_distribution_with_media(target, ids, inputs)
    drafter = _drafter(target)

    def repeated(rows, length):  # the media inputs of `rows` copies of the prompt, token types up to `length`
        types = torch.nn.functional.pad(inputs["mm_token_type_ids"], (0, length - ids.shape[1]))
        return dict(
            pixel_values=inputs["pixel_values"].repeat(rows, 1),
            image_grid_thw=inputs["image_grid_thw"].repeat(rows, 1),
            mm_token_type_ids=types.repeat(rows, 1),
        )

    _check_sampling(target, drafter, ids, probs, monkeypatch, media=repeated)


def _llava():
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    text = dict(
        model_type="llama",
        vocab_size=VOCAB,
        **TINY_DECODER,
        pad_token_id=PAD,
    )
    vision = dict(
        model_type="clip_vision_model",
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=8,
        patch_size=4,
    )
    config = LlavaConfig(
        text_config=text, vision_config=vision, image_token_index=IMAGE, vision_feature_select_strategy="default"
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).to(torch.float64).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(5.0)
    return model


def test_llava_image_prompts(oracle):
    """The same mechanism for a vision-language target with plain 1-D RoPE (LLaVA: a CLIP tower in front of Llama,
    4 image tokens of an 8x8 image): lossless on transformers 5.x; refused on 4.x, whose generate() prepares no
    prompt position ids for DFlash to continue."""
    target = _llava()
    ids = torch.tensor([[5, 6] + [IMAGE] * 4 + [7, 8, 9]])
    pixel_values = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    kwargs = dict(max_new_tokens=20, do_sample=False, pixel_values=pixel_values)
    expected = target.generate(ids, **kwargs)
    assert not torch.equal(target.generate(ids, **dict(kwargs, pixel_values=pixel_values + 1)), expected)
    drafter = _drafter(target)
    if MAJOR < 5:
        with pytest.raises(ValueError, match=r"\['pixel_values'\]\) with a DFlash drafter need transformers >= 5"):
            target.generate(ids, assistant_model=drafter, **kwargs)
        return
    assert torch.equal(target.generate(ids, assistant_model=drafter, **kwargs), expected)
    oracle([expected[0]], corrupt=0.3)
    assert torch.equal(target.generate(ids, assistant_model=drafter, **kwargs), expected)
    assert any(n > 1 for n in drafter.last_acceptance_lengths)


def _text_only_targets():
    targets = [pytest.param(lambda: make_target("llama"), id="llama")]
    if MAJOR >= 5:
        targets.append(pytest.param(lambda: make_family_target("qwen3_5"), id="qwen3_5_causal_lm"))
    return targets


@pytest.mark.parametrize("build", _text_only_targets())
def test_an_image_prompt_for_a_text_only_target_is_refused(build):
    """Qwen3_5ForCausalLM (the text model of Qwen3.5) and Llama take no pixel inputs: the image would be lost."""
    target = build()
    with pytest.raises(ValueError, match=r"takes no \['image_grid_thw', 'pixel_values'\]: it is a text-only model"):
        target.generate(
            torch.tensor([[5, VISION_START, IMAGE, IMAGE, IMAGE, IMAGE, VISION_END, 7]]),
            max_new_tokens=4,
            assistant_model=make_drafter(target),
            pixel_values=torch.zeros(4, PATCH_FEATURES),
            image_grid_thw=torch.tensor([[1, 2, 2]]),
        )


@pytest.mark.skipif(MAJOR < 5, reason="Qwen3.5 exists in transformers >= 5 only")
def test_image_prompts_that_dflash_cannot_continue_are_refused(monkeypatch):
    """Where generate() does not prepare the prompt's position ids (transformers 4.x), or the target prepares its
    later decoding steps' inputs itself, an image prompt is refused instead of decoded differently."""
    from transformers import Qwen3_5ForConditionalGeneration

    from transformers_dflash import target_model

    target = _qwen3_5_vl()
    ids, _, inputs = _vision_prompts([([5], (1, 2, 2), [7])])
    drafter = make_drafter(target)
    monkeypatch.setattr(target_model, "generate_prepares_position_ids", lambda: False)
    with pytest.raises(ValueError, match=r"need transformers >= 5"):
        target.generate(ids, max_new_tokens=4, assistant_model=drafter, **inputs)
    monkeypatch.undo()

    class OwnDecodingInputs(Qwen3_5ForConditionalGeneration):
        def prepare_inputs_for_generation(self, *args, **kwargs):
            return super().prepare_inputs_for_generation(*args, **kwargs)

    target.__class__ = OwnDecodingInputs
    with pytest.raises(ValueError, match=r"OwnDecodingInputs overrides \['prepare_inputs_for_generation'\]"):
        target.generate(ids, max_new_tokens=4, assistant_model=drafter, **inputs)


@pytest.mark.skipif(MAJOR < 5, reason="Qwen3.5 / 3.6 targets exist in transformers >= 5 only")
def test_released_qwen3_6_dflash_layout_on_a_tiny_hybrid_target(tmp_path, oracle):
    """The Qwen3.6-27B-DFlash layout (4 sliding + 1 full drafter layers, block_size and mask_token_id inside
    dflash_config, five target layers of a 3:1 linear/full hybrid) scaled down: zero missing keys, lossless."""
    import json

    from safetensors.torch import save_file
    from test_checkpoints import _released_config, _released_tensors

    from transformers_dflash import DFlashDraftModel

    target = make_family_target("qwen3_5", num_hidden_layers=8)  # 64 layers scaled to 8, same 3:1 pattern
    assert target.config.layer_types.count("full_attention") == 2
    config = _released_config(num_layers=5, block_size_inside=True, sliding=True)
    config["dflash_config"]["target_layer_ids"] = [1, 2, 3, 5, 6]  # five of eight, like [1, 16, 31, 46, 61] of 64
    config["num_target_layers"] = 8
    tensors = _released_tensors(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(tensors, tmp_path / "model.safetensors")
    drafter, info = DFlashDraftModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert drafter.config.layer_types == ["sliding_attention"] * 4 + ["full_attention"]
    assert drafter.config.block_size == 16 and drafter.config.mask_token_id == 95
    drafter = drafter.to(torch.float64)
    drafter.draft_length, drafter.ngram_lookup = "full", 0
    prompt = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(8))
    expected = target.generate(prompt, max_new_tokens=40, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=drafter), expected)
    oracle([expected[0]], corrupt=0.3)
    assert torch.equal(target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=drafter), expected)
    assert max(drafter.last_acceptance_lengths) > 4
