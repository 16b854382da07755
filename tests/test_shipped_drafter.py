"""The drafter shipped for SmolLM2-135M-Instruct: Hub layout, model card, loading through the Auto classes, and (when
SmolLM2 is installed) lossless decoding with drafts that are really accepted."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from transformers_dflash import SHIPPED_DRAFTER, DFlashDraftModel

REPO = Path(__file__).resolve().parents[1]
CARD = REPO / "model_cards" / "smollm2-135m-instruct-dflash.md"


def test_shipped_folder_holds_config_weights_and_card_only():
    """Its code is the installed package's: no hand copies of the core files to drift (export writes them)."""
    files = {p.name for p in SHIPPED_DRAFTER.iterdir()}
    assert files == {"config.json", "model.safetensors", "README.md"}
    config = json.loads((SHIPPED_DRAFTER / "config.json").read_text())
    assert config["model_type"] == "dflash" and "auto_map" not in config
    assert (config["hidden_size"], config["vocab_size"], config["num_target_layers"]) == (576, 49152, 30)
    from safetensors import safe_open

    with safe_open(str(SHIPPED_DRAFTER / "model.safetensors"), "pt") as f:
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys() if name != "draft_vocab_ids"}
    assert dtypes <= {"BF16", "F16"}
    assert (SHIPPED_DRAFTER / "model.safetensors").stat().st_size < 40 * 2**20  # modest
    # Stored in half precision, loaded in float32 when no dtype is given (transformers 5 loads a config's dtype by
    # default): a CPU drafter next to a float32 target drafts slower in bfloat16 on most CPUs (README). A re-export
    # writes the weights' dtype here; set it back.
    assert config["dtype"] == "float32"


def test_shipped_drafter_loads_in_float32_with_nothing_set():
    from transformers import AutoModel

    drafter = AutoModel.from_pretrained(SHIPPED_DRAFTER)
    assert drafter.dtype == torch.float32
    assert AutoModel.from_pretrained(SHIPPED_DRAFTER, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_model_card_is_the_folder_readme_and_has_hub_metadata():
    card = CARD.read_text()
    assert (SHIPPED_DRAFTER / "README.md").read_text() == card
    header = card.split("---")[1]
    for key in (
        "base_model: HuggingFaceTB/SmolLM2-135M-Instruct",
        "library_name: transformers",
        "- dflash",
        "- speculative-decoding",
    ):
        assert key in header
    assert "tau" in card and "speedup" in card.lower()


def test_loads_through_automodel(tmp_path):
    """As the README says: with the package imported, through the Auto classes, `trust_remote_code` or not."""
    from transformers import AutoModel

    for kwargs in ({}, {"trust_remote_code": True}):
        drafter = AutoModel.from_pretrained(SHIPPED_DRAFTER, dtype=torch.float32, **kwargs)
        assert type(drafter) is DFlashDraftModel
        assert drafter.draft_vocab_ids.shape == (drafter.config.draft_vocab_size,)


def test_its_hub_export_loads_without_this_package(tmp_path):
    """`dflash export --layout hub` of the shipped drafter, loaded with `AutoModel.from_pretrained(...,
    trust_remote_code=True)` in a process where transformers_dflash is hidden."""
    from transformers_dflash.interop import export_drafter

    exported = tmp_path / "exported"
    export_drafter(DFlashDraftModel.from_pretrained(SHIPPED_DRAFTER), exported, "hub")
    code = f"""
import sys
sys.modules["transformers_dflash"] = None  # make the installed package unimportable
from transformers import AutoModel
drafter = AutoModel.from_pretrained({str(exported)!r}, trust_remote_code=True)
assert type(drafter).__name__ == "DFlashDraftModel", type(drafter)
assert type(drafter).__module__.startswith("transformers_modules"), type(drafter).__module__
assert drafter.draft_vocab_ids.shape == (drafter.config.draft_vocab_size,)
print("ok", drafter.config.block_size)
"""
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("ok")


def _smollm2():
    from transformers_dflash import smollm2

    try:
        return smollm2.load_smollm2()
    except smollm2.SmolLM2NotAvailableError as error:
        pytest.skip(str(error))


def test_shipped_drafter_is_lossless_and_accepted_on_smollm2():
    from transformers_dflash.runtime import encode_chat

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target, tokenizer = _smollm2()
        drafter = DFlashDraftModel.from_pretrained(SHIPPED_DRAFTER, dtype=torch.float32).eval()
        drafter.draft_length, drafter.ngram_lookup = "full", 0  # the drafter's own acceptance, every block verified
        input_ids = encode_chat(tokenizer, "Write a Python function that returns the factorial of n.")
        kwargs = dict(attention_mask=torch.ones_like(input_ids), max_new_tokens=48, do_sample=False)
        with torch.inference_mode():
            plain = target.generate(input_ids, **kwargs)
            ours = target.generate(input_ids, assistant_model=drafter, **kwargs)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(plain, ours)
    steps = drafter.last_acceptance_lengths[1:]
    # A trained drafter: well above the 1.0 of a drafter whose drafts are all rejected (measured: see the card).
    assert sum(steps) / len(steps) > TAU_FLOOR


TAU_FLOOR = 1.3
