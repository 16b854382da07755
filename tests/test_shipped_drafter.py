"""The drafter shipped for SmolLM2-135M-Instruct: Hub layout, model card, loading through the Auto classes, and (when
SmolLM2 is installed) lossless decoding with drafts that are really accepted."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from transformers_dflash import DFlashDraftModel
from transformers_dflash.cli import SHIPPED_DRAFTER

REPO = Path(__file__).resolve().parents[1]
CARD = REPO / "model_cards" / "smollm2-135m-instruct-dflash.md"


def test_shipped_folder_is_a_hub_checkpoint():
    files = {p.name for p in SHIPPED_DRAFTER.iterdir()}
    assert {"config.json", "model.safetensors", "configuration_dflash.py", "modeling_dflash.py",
            "generation_dflash.py", "README.md"} <= files
    assert not any(name.endswith((".bin", ".pt", ".pth", ".pkl")) for name in files)
    config = json.loads((SHIPPED_DRAFTER / "config.json").read_text())
    assert config["auto_map"]["AutoModel"] == "modeling_dflash.DFlashDraftModel"
    assert (config["hidden_size"], config["vocab_size"], config["num_target_layers"]) == (576, 49152, 30)
    from safetensors import safe_open

    with safe_open(str(SHIPPED_DRAFTER / "model.safetensors"), "pt") as f:
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys() if name != "draft_vocab_ids"}
    assert dtypes <= {"BF16", "F16"}
    assert (SHIPPED_DRAFTER / "model.safetensors").stat().st_size < 40 * 2**20  # modest


def test_model_card_is_the_folder_readme_and_has_hub_metadata():
    card = CARD.read_text()
    assert (SHIPPED_DRAFTER / "README.md").read_text() == card
    header = card.split("---")[1]
    for key in ("base_model: HuggingFaceTB/SmolLM2-135M-Instruct", "library_name: transformers", "- dflash",
                "- speculative-decoding"):
        assert key in header
    assert "tau" in card and "speedup" in card.lower()


def test_loads_through_automodel_without_this_package(tmp_path):
    """`AutoModel.from_pretrained(..., trust_remote_code=True)` in a process where transformers_dflash is hidden."""
    code = f"""
import sys
sys.modules["transformers_dflash"] = None  # make the installed package unimportable
from transformers import AutoModel
drafter = AutoModel.from_pretrained({str(SHIPPED_DRAFTER)!r}, trust_remote_code=True)
assert type(drafter).__name__ == "DFlashDraftModel", type(drafter)
assert type(drafter).__module__.startswith("transformers_modules"), type(drafter).__module__
assert drafter.draft_vocab_ids.shape == (drafter.config.draft_vocab_size,)
print("ok", drafter.config.block_size)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                            env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("ok")


def _smollm2():
    from transformers_dflash import smollm2

    try:
        return smollm2.load_smollm2()
    except smollm2.SmolLM2NotAvailableError as error:
        pytest.skip(str(error))


def test_shipped_drafter_is_lossless_and_accepted_on_smollm2():
    from transformers_dflash.cli import encode_chat

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target, tokenizer = _smollm2()
        drafter = DFlashDraftModel.from_pretrained(SHIPPED_DRAFTER, dtype=torch.float32).eval()
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


def test_shipped_code_is_the_package_code():
    """The checkpoint carries its own copy of the core files (for `trust_remote_code` without this package); it must
    not drift from them. After changing a core file, copy it into the shipped folder."""
    package = SHIPPED_DRAFTER.parents[1]
    for name in ("configuration_dflash.py", "modeling_dflash.py", "generation_dflash.py"):
        assert (SHIPPED_DRAFTER / name).read_text() == (package / name).read_text(), f"copy {name} into {SHIPPED_DRAFTER}"
