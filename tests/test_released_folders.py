"""Released DFlash folders (z-lab's layout) loaded the ways their model cards say, with this package imported.

- A folder that carries z-lab's own `dflash.py` loads, through `AutoModel.from_pretrained(path,
  trust_remote_code=True)`, as z-lab's class; passed as `assistant_model` it is adopted: our drafter, holding its very
  Parameter objects, decodes (losslessly, with partial acceptance too).
- A folder loaded without that code is a plain `Qwen3Model` (fc and hidden_norm dropped, embeddings random); passed
  as `assistant_model` it is refused with the call to make instead, which works.

z-lab's class is replaced here by a stand-in written from its documented interface (github z-lab/dflash,
model/dflash.py: a `Qwen3PreTrainedModel` with `config_class = Qwen3Config`, the released module names, its own
`forward` and `spec_generate`); its forward raises, so every test also shows that decoding never runs it.
"""

import json
import re
import sys

import pytest
import torch
import transformers.dynamic_module_utils
from conftest import VOCAB, make_target, random_prompt
from safetensors.torch import load_file, save_file
from test_checkpoints import _released_config, _released_tensors
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM

from transformers_dflash import DFlashDraftModel

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK_SIZE = 8
NEW_TOKENS = 40

STAND_IN = '''"""Test stand-in for z-lab's released dflash.py: its interface, not its code."""
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3DecoderLayer,
    Qwen3PreTrainedModel,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
)


class DFlashDraftModel(Qwen3PreTrainedModel):
    config_class = Qwen3Config
    _no_split_modules = ["Qwen3DecoderLayer"]

    def __init__(self, config):
        super().__init__(config)
        self.config = config
        self.layers = nn.ModuleList([Qwen3DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.target_layer_ids = config.dflash_config["target_layer_ids"]
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.block_size = config.block_size
        self.mask_token_id = config.dflash_config["mask_token_id"]
        self.post_init()

    def forward(self, position_ids, attention_mask=None, noise_embedding=None, target_hidden=None,
                past_key_values=None, use_cache=False, **kwargs):
        raise AssertionError("DFlash decoding ran the released class's own forward")

    def spec_generate(self, *args, **kwargs):
        raise AssertionError("DFlash decoding ran the released class's own spec_generate")
'''


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The same released checkpoint twice: with z-lab's code (stand-in) next to it, and without code."""
    root = tmp_path_factory.mktemp("released")
    config = _released_config(num_layers=2)
    config["block_size"] = BLOCK_SIZE
    tensors = _released_tensors(config)
    made = {}
    for name in ("with_code", "without_code"):
        folder = root / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        save_file(tensors, folder / "model.safetensors")
        made[name] = folder
    (made["with_code"] / "dflash.py").write_text(STAND_IN)
    return made


@pytest.fixture
def load_with_its_code(tmp_path, monkeypatch):
    """`AutoModel.from_pretrained(folder, trust_remote_code=True)`, its code copied under tmp_path (not ~/.cache)."""
    monkeypatch.setattr(transformers.dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))  # transformers appends the modules folder

    def load(folder, **kwargs):
        return AutoModel.from_pretrained(folder, trust_remote_code=True, **kwargs).eval()

    return load


@pytest.fixture(scope="module")
def target():
    return make_target("qwen3", num_layers=4, eos_token_id=None)  # float64; the released config's 4-layer target


def released_state(folder):
    return load_file(folder / "model.safetensors")


def test_released_class_is_adopted_with_its_own_weights(folders, load_with_its_code, target):
    released = load_with_its_code(folders["with_code"], dtype=torch.float32)
    assert (
        type(released).__module__.startswith("transformers_modules") and type(released).__name__ == "DFlashDraftModel"
    )
    assert not isinstance(released, DFlashDraftModel)
    prompt = random_prompt(9, seed=4)
    expected = target.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)

    out = target.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=released)
    assert torch.equal(out, expected)
    drafter = DFlashDraftModel.from_released_model(released)
    assert type(drafter) is DFlashDraftModel and DFlashDraftModel.from_released_model(released) is drafter
    assert released.last_acceptance_lengths is drafter.last_acceptance_lengths
    assert sum(released.last_acceptance_lengths) == NEW_TOKENS
    # the same Parameter objects (no copy), in the released model's dtype; its state dict stays the released one
    theirs, mine = released.state_dict(keep_vars=True), drafter.state_dict(keep_vars=True)
    assert theirs.keys() == mine.keys() == released_state(folders["with_code"]).keys()
    for name, tensor in theirs.items():
        assert mine[name] is tensor and mine[name].data_ptr() == tensor.data_ptr() and tensor.dtype == torch.float32
    assert not any(isinstance(m, DFlashDraftModel) for m in released.modules())

    # ... and they compute what our own loader's drafter of the same folder computes
    loaded = DFlashDraftModel.from_pretrained(folders["with_code"], dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    inputs = dict(
        block_embeddings=torch.randn(1, BLOCK_SIZE, 32, generator=g),
        context_features=torch.randn(1, 5, 3 * 32, generator=g),
        block_position_ids=torch.arange(5, 5 + BLOCK_SIZE)[None],
        context_position_ids=torch.arange(5)[None],
    )
    with torch.no_grad():
        assert torch.equal(drafter(**inputs).last_hidden_state, loaded(**inputs).last_hidden_state)

    # run-time settings set on the released model reach the drafter; `.to()` is followed (same Parameters)
    released.draft_length, released.ngram_lookup = "full", 0
    released.to(torch.float64)
    out = target.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=released)
    assert torch.equal(out, expected)
    assert DFlashDraftModel.from_released_model(released) is drafter
    assert (drafter.draft_length, drafter.ngram_lookup) == ("full", 0)
    assert drafter.fc.weight.dtype == torch.float64 and drafter.fc.weight is released.fc.weight
    loaded.to(torch.float64)
    loaded.draft_length, loaded.ngram_lookup = "full", 0
    target.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=loaded)
    assert released.last_acceptance_lengths == loaded.last_acceptance_lengths

    # parameters replaced on the released model: a new drafter holds the new ones
    released.fc.weight = nn.Parameter(torch.zeros_like(released.fc.weight))
    rebuilt = DFlashDraftModel.from_released_model(released)
    assert rebuilt is not drafter and rebuilt.fc.weight is released.fc.weight


def test_adopted_released_class_is_lossless_under_partial_acceptance(folders, load_with_its_code, target, oracle):
    released = load_with_its_code(folders["with_code"], dtype=torch.float64)
    prompt = random_prompt(7, seed=5)
    expected = target.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    oracle([expected[0]], corrupt=0.3)
    out = target.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=released)
    assert torch.equal(out, expected)
    lengths = released.last_acceptance_lengths
    assert sum(lengths) == NEW_TOKENS and max(lengths) > 4  # long accepted prefixes ...
    assert any(1 < n < BLOCK_SIZE for n in lengths[1:])  # ... and partial accepts


def _no_code_auto_model(folders, load):
    return AutoModel.from_pretrained(folders["without_code"])


def _no_code_causal_lm(folders, load):
    return AutoModelForCausalLM.from_pretrained(folders["without_code"])


def _code_folder_without_trust(folders, load):
    return AutoModel.from_pretrained(folders["with_code"])  # trust_remote_code not given: transformers' Qwen3Model


@pytest.mark.parametrize(
    "load_wrongly, model_class",
    [
        (_no_code_auto_model, "Qwen3Model"),
        (_no_code_causal_lm, "Qwen3ForCausalLM"),
        (_code_folder_without_trust, "Qwen3Model"),
    ],
)
def test_released_folder_loaded_as_a_plain_model_is_refused_with_the_call_to_make(
    folders, load_with_its_code, target, load_wrongly, model_class
):
    wrong = load_wrongly(folders, load_with_its_code)
    assert type(wrong).__name__ == model_class and "fc.weight" not in wrong.state_dict()
    prompt = random_prompt(9, seed=4)
    with pytest.raises(ValueError) as refused:
        target.generate(prompt, max_new_tokens=8, do_sample=False, assistant_model=wrong)
    message = str(refused.value)
    folder = wrong.config.name_or_path
    assert f"This {model_class} is a DFlash drafter checkpoint" in message
    assert "fc and hidden_norm weights were dropped" in message and "embed_tokens" in message
    call = re.search(r"transformers_dflash\.(DFlashDraftModel\.from_pretrained\('([^']+)'\))", message)
    assert call and call.group(2) == str(folder)
    assert "dflash export --layout hub" in message
    # the call it names works
    drafter = DFlashDraftModel.from_pretrained(call.group(2))
    out = target.generate(prompt, max_new_tokens=8, do_sample=False, assistant_model=drafter)
    assert torch.equal(out, target.generate(prompt, max_new_tokens=8, do_sample=False))


def test_released_model_whose_tensors_do_not_fit_is_refused(folders, load_with_its_code):
    released = load_with_its_code(folders["with_code"])
    released.register_parameter("extra", nn.Parameter(torch.zeros(3)))
    with pytest.raises(ValueError, match=r"unexpected tensors: \['extra'\]"):
        DFlashDraftModel.from_released_model(released)
    offloaded = load_with_its_code(folders["with_code"]).to("meta")
    with pytest.raises(ValueError, match="meta device"):
        DFlashDraftModel.from_released_model(offloaded)


@pytest.mark.parametrize("variant", ["with_code", "without_code"])
def test_both_released_folders_load_with_our_from_pretrained(folders, variant):
    """Our loader reads the folder's config.json and weights and runs none of its code."""
    drafter, info = DFlashDraftModel.from_pretrained(folders[variant], output_loading_info=True)
    assert type(drafter) is DFlashDraftModel
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert drafter.config.block_size == BLOCK_SIZE and drafter.config.mask_token_id == VOCAB - 1
    state, stored = drafter.state_dict(), released_state(folders[variant])
    assert state.keys() == stored.keys()
    assert all(torch.equal(state[name].to(stored[name].dtype), stored[name]) for name in stored)
