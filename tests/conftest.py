"""Tiny randomly initialised targets and drafters, built in-process (CI has no model hub)."""

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import transformers_dflash  # noqa: F401  (installs the generation hook)
from transformers_dflash import DFlashCandidateGenerator, DFlashDraftModel

torch.set_num_threads(min(2, os.cpu_count() or 1))
# The suite measures kernel choices afresh (tests swap the table of choices) and must not write to the user's cache:
# the choices stay in memory (`kernel_choices`; tests of the file set their own folder).
os.environ["DFLASH_KERNEL_CACHE"] = "off"

VOCAB = 96
EOS, PAD, BOS = 2, 0, 1

# Decoder-only families the generation path must serve. Mistral and Gemma2 get a small sliding window so that
# prompts + generations cross it.
ARCHITECTURES = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {"sliding_window": 8},
    "gemma": {},
    "gemma2": {"sliding_window": 8},
}


def make_target(
    arch="llama",
    attn="sdpa",
    dtype=torch.float64,
    seed=0,
    num_layers=4,
    eos_token_id=EOS,
    vocab_size=VOCAB,
    **overrides,
):
    settings = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        bos_token_id=BOS,
        eos_token_id=eos_token_id,
        pad_token_id=PAD,
    )
    config = AutoConfig.for_model(arch, **{**settings, **ARCHITECTURES.get(arch, {}), **overrides})
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    except ValueError:  # e.g. Gemma2 has no SDPA path in transformers 5.x
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype)
    # Random init with std 0.02 gives near-uniform logits; a larger scale makes the target's choices (and loops,
    # hence accepted drafts) more typical of a real model.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(5.0)
    return model.eval()


def make_drafter(target, num_layers=2, block_size=4, seed=1, **kwargs):
    torch.manual_seed(seed)
    return DFlashDraftModel.from_target(target, num_layers=num_layers, block_size=block_size, **kwargs).eval()


def random_prompt(length, seed, batch=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g)


class Oracle:
    """Replaces the drafter's proposals by known continuations (randomly corrupted), so tests exercise long
    accepted prefixes, partial accepts and full rejections. Any proposal must leave the output unchanged."""

    def __init__(self, references, corrupt=0.3, seed=0):
        self.next_tokens = {}
        for ref in references:
            ref = ref.tolist()
            for pos in range(len(ref) - 1):
                self.next_tokens.setdefault((pos, ref[pos]), ref[pos + 1 :])
        self.corrupt = corrupt
        self.generator = torch.Generator().manual_seed(seed)
        self.calls = 0

    def install(self, monkeypatch):
        """Patch the proposals in. A drafter left at the device's default settings verifies whole blocks without copied
        drafts while the oracle is in (the partial accepts it is there to exercise); explicit settings are kept."""
        from transformers_dflash import candidate_generator

        policy, lookup = candidate_generator.draft_length_policy, candidate_generator.ngram_lookup_for
        monkeypatch.setattr(
            candidate_generator, "draft_length_policy", lambda s, device: policy("full" if s is None else s, device)
        )
        monkeypatch.setattr(
            candidate_generator, "ngram_lookup_for", lambda s, size, device: lookup(0 if s is None else s, size, device)
        )
        original = DFlashCandidateGenerator.draft
        oracle = self

        def draft(generator, anchor_ids, anchor_position_ids, *args, **kwargs):
            drafts, confidence = original(generator, anchor_ids, anchor_position_ids, *args, **kwargs)
            oracle.calls += 1
            for row in range(drafts.shape[0]):
                key = (int(anchor_position_ids[row]), int(anchor_ids[row]))
                cont = oracle.next_tokens.get(key, [])[: drafts.shape[1]]
                if cont:
                    drafts[row, : len(cont)] = torch.tensor(cont, dtype=drafts.dtype)
                if torch.rand((), generator=oracle.generator) < oracle.corrupt:
                    j = int(torch.randint(0, drafts.shape[1], (), generator=oracle.generator))
                    drafts[row, j] = (drafts[row, j] + 1) % VOCAB
            return drafts, confidence

        monkeypatch.setattr(DFlashCandidateGenerator, "draft", draft)
        return self


@pytest.fixture
def oracle(monkeypatch):
    def make(references, **kwargs):
        return Oracle(references, **kwargs).install(monkeypatch)

    return make


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one torch thread (several threads mostly wait on each other, worse on a busy
    machine). Modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def load_script(name):
    """scripts/<name>.py as a module (the scripts are files, not a package)."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
