"""Hub-layout checkpoints: save/load, the trust_remote_code round trip without our package, and the released layout."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import make_drafter, make_target, random_prompt
from safetensors.torch import load_file, save_file
from transformers import AutoModel

from transformers_dflash import DFlashConfig, DFlashDraftModel
from transformers_dflash.code_files import code_files
from transformers_dflash.configuration_dflash import default_target_layer_ids


def test_save_pretrained_writes_a_self_contained_hub_folder(tmp_path):
    target = make_target("qwen3")
    drafter = make_drafter(target)
    drafter.save_pretrained(tmp_path)
    files = set(os.listdir(tmp_path))
    core = [path.name for path in code_files()]
    assert core[0] == "dflash.py" and {"modeling_dflash.py", "configuration_dflash.py", "decoding.py"} <= set(core)
    assert {"config.json", "model.safetensors", *core} <= files
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_dflash.DFlashConfig",
        "AutoModel": "dflash.DFlashDraftModel",
    }
    assert config["dflash_config"] == {"block_size": 4, "mask_token_id": 95, "target_layer_ids": [0, 1, 2]}
    # The copied code imports only torch and transformers (and its sibling files).
    for name in core:
        for line in (tmp_path / name).read_text().splitlines():
            if line.startswith(("import ", "from ")):
                top = line.split()[1].split(".")[0]
                assert top in {"torch", "transformers", ""} or top in sys.stdlib_module_names, line
    reloaded = AutoModel.from_pretrained(tmp_path)  # registered with the Auto classes by our package
    assert type(reloaded) is DFlashDraftModel
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name].to(tensor.dtype), tensor)


def test_trust_remote_code_round_trip_without_our_package(tmp_path):
    target = make_target("qwen3", dtype=torch.float32, eos_token_id=None)
    drafter = make_drafter(target, block_size=5)
    target.save_pretrained(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "drafter")
    prompt = random_prompt(6, seed=3)
    script = textwrap.dedent(
        f"""
        import sys, json, torch
        sys.modules["transformers_dflash"] = None  # make `import transformers_dflash` fail, as on a machine without it
        from transformers import AutoModel, AutoModelForCausalLM
        target = AutoModelForCausalLM.from_pretrained({str(tmp_path / "target")!r})
        drafter = AutoModel.from_pretrained({str(tmp_path / "drafter")!r}, trust_remote_code=True)
        assert "transformers_dflash" not in type(drafter).__module__, type(drafter).__module__
        prompt = torch.tensor({prompt.tolist()})
        plain = target.generate(prompt, max_new_tokens=20, do_sample=False)
        fast = target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=drafter)
        print(json.dumps({{"equal": bool(torch.equal(plain, fast)), "lengths": drafter.last_acceptance_lengths,
                          "module": type(drafter).__module__}}))
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["equal"] and sum(report["lengths"]) == 20
    assert report["module"].startswith("transformers_modules")


def _released_config(num_layers=5, block_size_inside=False, sliding=False):
    """A released DFlash config.json (Qwen3-8B drafter keys, see the spec), scaled down to test size."""
    config = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "block_size": 16,
        "dflash_config": {"mask_token_id": 95, "target_layer_ids": [0, 1, 2]},
        "num_target_layers": 4,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000,
        "rope_scaling": None,
        "max_position_embeddings": 40960,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "layer_types": ["full_attention"] * num_layers,
        "sliding_window": None,
        "use_sliding_window": False,
        "max_window_layers": num_layers,
        "tie_word_embeddings": False,
        "vocab_size": 96,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": "bfloat16",
        "initializer_range": 0.02,
    }
    if block_size_inside:  # Qwen3.5-style: block_size inside dflash_config, sliding + full layers
        config["dflash_config"]["block_size"] = config.pop("block_size")
    if sliding:
        config["layer_types"] = ["sliding_attention"] * (num_layers - 1) + ["full_attention"]
        config["sliding_window"] = 6
        config["use_sliding_window"] = True
    return config


def _released_tensors(config):
    hidden, inter, heads, kv, head_dim = 32, 64, 4, 2, 8
    shapes = {
        "fc.weight": (hidden, hidden * len(config["dflash_config"]["target_layer_ids"])),
        "hidden_norm.weight": (hidden,),
        "norm.weight": (hidden,),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": (head_dim,),
            p + "self_attn.k_norm.weight": (head_dim,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    g = torch.Generator().manual_seed(0)
    return {name: (torch.randn(shape, generator=g) * 0.1).to(torch.bfloat16) for name, shape in shapes.items()}


@pytest.mark.parametrize("variant", ["qwen3", "qwen3.5"])
def test_released_checkpoint_layout_loads_exactly(tmp_path, variant):
    config = _released_config(block_size_inside=variant == "qwen3.5", sliding=variant == "qwen3.5")
    tensors = _released_tensors(config)
    assert len(tensors) == 58  # as the spec says for 5 layers
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(tensors, tmp_path / "model.safetensors")
    drafter, info = DFlashDraftModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert drafter.config.block_size == 16
    assert drafter.config.mask_token_id == 95 and drafter.config.target_layer_ids == [0, 1, 2]
    assert drafter.config.rope_parameters["rope_theta"] == 1000000
    state = drafter.state_dict()
    assert set(state) == set(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(state[name].to(torch.bfloat16), tensor)
    # ... and it drafts for a fitting target without changing the output
    target = make_target("qwen3", dtype=torch.float32, eos_token_id=None)
    drafter = drafter.float()
    prompt = random_prompt(9, seed=0)
    expected = target.generate(prompt, max_new_tokens=20, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=drafter), expected)


def test_missing_mis_shaped_and_pickled_checkpoints_are_refused(tmp_path):
    drafter = make_drafter(make_target("llama"))
    drafter.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "norm.weight"}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors: \['norm.weight'\]"):
        DFlashDraftModel.from_pretrained(tmp_path)
    save_file({**tensors, "fc.weight": tensors["fc.weight"][:, :8].contiguous()}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="shapes do not match"):
        DFlashDraftModel.from_pretrained(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    torch.save(tensors, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="safetensors only"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_default_target_layer_ids_follow_the_spec():
    assert default_target_layer_ids(36) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(32) == [1, 8, 15, 22, 29]
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(4) == [0, 1, 2]  # too shallow for the formula: spread, last layer excluded
    assert default_target_layer_ids(2) == [0]


def test_config_reads_both_rope_spellings():
    old = DFlashConfig(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    new = DFlashConfig(rope_parameters={"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0})
    assert old.rope_parameters == new.rope_parameters == {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}


def test_from_target_copies_shapes_and_rope():
    target = make_target(
        "llama",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    drafter = make_drafter(target, num_layers=3, block_size=10)
    assert drafter.config.rope_parameters["rope_type"] == "llama3"
    assert drafter.config.hidden_size == 32 and drafter.config.num_key_value_heads == 2
    assert drafter.config.num_hidden_layers == 3 and drafter.config.block_size == 10
    assert not any("embed" in name or "lm_head" in name for name, _ in drafter.named_parameters())
    prompt = random_prompt(5, seed=0)
    expected = target.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=drafter), expected)


def test_truncated_weights_file_names_the_file_and_the_fix(tmp_path):
    target = make_target("qwen3")
    make_drafter(target).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match="model.safetensors .* truncated or corrupt.*export the drafter again"):
        AutoModel.from_pretrained(tmp_path)
