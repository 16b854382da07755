"""Interop: export to the hub / released DFlash / vLLM speculators layouts, convert back, push_to_hub, model cards.

Round trips keep every tensor bit-identical and the drafts identical; every exported folder is checked against its
documented schema here, independently of `check_layout`; pickled weights are refused without being unpickled.
"""

import ast
import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import make_drafter, make_target, random_prompt
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from transformers_dflash import DFlashCandidateGenerator, DFlashDraftModel
from transformers_dflash import model_card as cards
from transformers_dflash.cli import main as cli_main
from transformers_dflash.code_files import code_files
from transformers_dflash.interop import (
    check_layout,
    convert_drafter,
    detect_layout,
    export_drafter,
    push_drafter_to_hub,
)

torch.set_num_threads(1)

NUM_TARGET_LAYERS = 8  # default target layers [1, 2, 3, 4, 5]: the last layer (7) stays out, as for real targets
TARGET_ID = "tiny-org/tiny-qwen3"
CODE_FILES = {path.name for path in code_files()}

# shared/docs/dflash-spec.md, "Released checkpoint config.json" (Qwen3-8B drafter): the exact key set.
RELEASED_KEYS = {
    "architectures": list,
    "auto_map": dict,
    "model_type": str,
    "block_size": int,
    "dflash_config": dict,
    "num_target_layers": int,
    "hidden_size": int,
    "intermediate_size": int,
    "num_hidden_layers": int,
    "num_attention_heads": int,
    "num_key_value_heads": int,
    "head_dim": int,
    "hidden_act": str,
    "rms_norm_eps": float,
    "rope_theta": (int, float),
    "rope_scaling": (dict, type(None)),
    "max_position_embeddings": int,
    "attention_bias": bool,
    "attention_dropout": float,
    "layer_types": list,
    "sliding_window": (int, type(None)),
    "use_sliding_window": bool,
    "max_window_layers": int,
    "tie_word_embeddings": bool,
    "vocab_size": int,
    "bos_token_id": (int, type(None)),
    "eos_token_id": (int, list, type(None)),
    "dtype": str,
    "initializer_range": float,
}
# vllm-project/speculators: src/speculators/config.py + src/speculators/models/dflash/config.py
SPECULATORS_KEYS = {
    "speculators_model_type": str,
    "speculators_version": str,
    "speculators_config": dict,
    "transformer_layer_config": dict,
    "draft_vocab_size": int,
    "block_size": int,
    "target_hidden_size": int,
    "aux_hidden_state_layer_ids": list,
    "mask_token_id": int,
}


def assert_types(content, schema):
    for key, types in schema.items():
        assert key in content, f"missing {key}"
        assert isinstance(content[key], types) and not (types is int and isinstance(content[key], bool)), key


# --------------------------------------------------------------------------------------------------------------------
# Tiny models


@pytest.fixture(scope="module")
def target():
    return make_target("qwen3", dtype=torch.float32, num_layers=NUM_TARGET_LAYERS, eos_token_id=None)


def build_drafter(target, variant="full", dtype=torch.float32):
    overrides = {}
    if variant == "sliding":  # Qwen3.5-style: sliding + full layers
        overrides = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6, use_sliding_window=True)
    drafter = make_drafter(target, num_layers=2, block_size=4, **overrides)
    with torch.no_grad():  # norms start at exactly 1: perturb them so that "bit-identical" means something
        g = torch.Generator().manual_seed(7)
        for p in drafter.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return drafter.to(dtype).eval()


def assert_same_tensors(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), name


def assert_same_config(a, b):
    for key in (
        "block_size",
        "mask_token_id",
        "target_layer_ids",
        "num_target_layers",
        "layer_types",
        "sliding_window",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "rms_norm_eps",
        "max_position_embeddings",
        "vocab_size",
    ):
        assert getattr(a.config, key) == getattr(b.config, key), key
    assert a.config.rope_parameters == b.config.rope_parameters


@torch.no_grad()
def draft_once(drafter, target, prompt):
    """(block hidden states, drafted ids) for one draft after a prefill of `prompt[:, :-1]`, anchor `prompt[:, -1]`."""
    generator = DFlashCandidateGenerator(drafter, target)
    try:
        n = prompt.shape[1] - 1
        target(prompt[:, :n])
        features = generator.captured_features()
        positions = torch.arange(n)[None]
        drafts, _ = generator.draft(prompt[:, -1], torch.tensor([n]), features, positions)
        block = torch.full((1, drafter.config.block_size), drafter.config.mask_token_id)
        block[:, 0] = prompt[:, -1]
        dtype = next(drafter.parameters()).dtype
        hidden = drafter(
            block_embeddings=target.get_input_embeddings()(block).to(dtype),
            context_features=features.to(dtype),
            block_position_ids=n + torch.arange(drafter.config.block_size)[None],
            context_position_ids=positions,
        ).last_hidden_state
        return hidden, drafts
    finally:
        generator.close()


def assert_same_drafts(a, b, target):
    prompt = random_prompt(12, seed=4)  # longer than the sliding window (6)
    hidden_a, drafts_a = draft_once(a, target, prompt)
    hidden_b, drafts_b = draft_once(b, target, prompt)
    assert torch.equal(hidden_a, hidden_b)
    assert torch.equal(drafts_a, drafts_b)
    plain = target.generate(prompt, max_new_tokens=16, do_sample=False)
    for drafter in (a, b):  # whole blocks, no copies: the same drafts give the same steps whatever the timing
        drafter.draft_length, drafter.ngram_lookup = "full", 0
    out_a = target.generate(prompt, max_new_tokens=16, do_sample=False, assistant_model=a)
    lengths_a = list(a.last_acceptance_lengths)
    out_b = target.generate(prompt, max_new_tokens=16, do_sample=False, assistant_model=b)
    assert torch.equal(out_a, plain) and torch.equal(out_b, plain)
    assert b.last_acceptance_lengths == lengths_a  # the same drafts at every step


def check_code_files(folder: Path):
    """Every .py imports only torch, transformers, the standard library or a sibling file, and at import time does
    nothing but define things and register the generation hook."""
    allowed_calls = {"register_for_auto_class", "install_generation_hook"}
    for path in folder.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert (folder / f"{node.module.split('.')[0]}.py").is_file(), (path.name, node.module)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                for name in names:
                    root = name.split(".")[0]
                    assert root in {"torch", "transformers"} or root in sys.stdlib_module_names, (path.name, name)
        for node in tree.body:
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
                func = node.value.func
                assert getattr(func, "attr", getattr(func, "id", None)) in allowed_calls, (path.name, ast.dump(func))
            else:
                assert isinstance(
                    node,
                    (
                        ast.Expr,
                        ast.Import,
                        ast.ImportFrom,
                        ast.FunctionDef,
                        ast.ClassDef,
                        ast.Assign,
                        ast.AnnAssign,
                        ast.Try,
                        ast.If,
                    ),
                ), (path.name, type(node))


def tensor_names(folder: Path) -> dict:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def spec_tensor_names(num_layers):
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(num_layers):
        names |= {f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        names |= {f"layers.{i}.self_attn.{p}_norm.weight" for p in "qk"}
        names |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        names |= {f"layers.{i}.{p}_layernorm.weight" for p in ("input", "post_attention")}
    return names


def check_released_schema(folder: Path, drafter):
    config = json.loads((folder / "config.json").read_text())
    assert set(config) == set(RELEASED_KEYS)  # exactly the released keys, nothing of ours
    assert_types(config, RELEASED_KEYS)
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert config["model_type"] == "qwen3"
    assert config["dflash_config"]["mask_token_id"] == drafter.config.mask_token_id
    assert config["dflash_config"]["target_layer_ids"] == drafter.config.target_layer_ids == [1, 2, 3, 4, 5]
    assert config["block_size"] == config["dflash_config"]["block_size"] == 4
    assert config["num_target_layers"] == NUM_TARGET_LAYERS
    assert config["dtype"] == str(next(drafter.parameters()).dtype).replace("torch.", "")
    assert config["use_sliding_window"] == ("sliding_attention" in config["layer_types"])
    assert {"dflash.py", *CODE_FILES} <= set(os.listdir(folder))
    names = tensor_names(folder)
    assert set(names) == spec_tensor_names(2)
    assert names["fc.weight"] == (32, 5 * 32)


def check_speculators_schema(folder: Path, drafter, verifier):
    config = json.loads((folder / "config.json").read_text())
    assert_types(config, SPECULATORS_KEYS)
    assert config["speculators_model_type"] == "dflash"
    algorithm = config["speculators_config"]
    assert algorithm["algorithm"] == "dflash"
    assert algorithm["default_proposal_method"] == "greedy"
    assert algorithm["proposal_methods"][0]["proposal_type"] == "greedy"
    assert algorithm["proposal_methods"][0]["speculative_tokens"] == drafter.config.block_size - 1
    assert algorithm["verifier"]["name_or_path"] == verifier
    assert isinstance(algorithm["verifier"]["architectures"], list)
    assert config["draft_vocab_size"] == drafter.config.vocab_size
    assert config["target_hidden_size"] == drafter.config.hidden_size
    assert config["mask_token_id"] == drafter.config.mask_token_id
    # vLLM's update_dflash: dflash_config.target_layer_ids = aux - 1, the released/our indexing
    assert [i - 1 for i in config["aux_hidden_state_layer_ids"]] == drafter.config.target_layer_ids
    # speculators reads transformer_layer_config through the transformers class its model_type names
    layer_config = AutoConfig.for_model(**config["transformer_layer_config"])
    assert layer_config.model_type == "qwen3"
    assert layer_config.num_hidden_layers == 2 and layer_config.head_dim == 8 and layer_config.hidden_size == 32
    assert list(layer_config.layer_types) == drafter.config.layer_types
    theta = getattr(layer_config, "rope_theta", None) or layer_config.rope_parameters["rope_theta"]
    assert theta == drafter.config.rope_parameters["rope_theta"]
    assert not any(name.endswith(".py") for name in os.listdir(folder))
    assert set(tensor_names(folder)) == spec_tensor_names(2)


def check_hub_schema(folder: Path):
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "dflash"
    assert config["auto_map"] == {
        "AutoConfig": "configuration_dflash.DFlashConfig",
        "AutoModel": "dflash.DFlashDraftModel",
    }
    assert CODE_FILES <= set(os.listdir(folder))
    assert set(tensor_names(folder)) == spec_tensor_names(2)


def check_card(folder: Path, target_id):
    from huggingface_hub import ModelCard

    card = ModelCard.load(folder / "README.md")
    data = card.data.to_dict()
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert {"dflash", "speculative-decoding"} <= set(data["tags"])
    assert data.get("base_model") == target_id
    return card


# --------------------------------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize(
    "layout, variant, dtype",
    [
        ("released", "full", torch.float32),
        ("released", "sliding", torch.bfloat16),
        ("speculators", "full", torch.bfloat16),
        ("speculators", "sliding", torch.float32),
        ("hub", "full", torch.float32),
    ],
)
def test_round_trip_keeps_tensors_and_drafts(tmp_path, target, layout, variant, dtype):
    drafter = build_drafter(target, variant, dtype)
    folder = export_drafter(
        drafter,
        tmp_path / layout,
        layout,
        target_name_or_path=TARGET_ID,
        card_metadata={"steps": 123, "acceptance_length": 2.5},
    )
    {
        "released": lambda: check_released_schema(folder, drafter),
        "speculators": lambda: check_speculators_schema(folder, drafter, TARGET_ID),
        "hub": lambda: check_hub_schema(folder),
    }[layout]()
    check_code_files(folder)
    card = check_card(folder, TARGET_ID)
    assert "123" in card.text and "2.50" in card.text
    assert not [n for n in os.listdir(folder) if n.endswith((".bin", ".pt", ".pth", ".pkl"))]
    assert detect_layout(folder) == layout and check_layout(folder) == []

    back = convert_drafter(folder)
    assert type(back) is DFlashDraftModel
    assert_same_tensors(drafter, back)
    assert_same_config(drafter, back)
    assert_same_drafts(drafter, back, target)

    # exporting the converted drafter again gives the same files (config.json and tensors)
    again = export_drafter(back, tmp_path / "again", layout, target_name_or_path=TARGET_ID)
    if layout != "hub":
        assert json.loads((again / "config.json").read_text()) == json.loads((folder / "config.json").read_text())
        check_hub_schema(export_drafter(back, tmp_path / "as-hub", "hub"))  # no released/speculators leftovers
    first, second = load_file(folder / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_released_layout_loads_with_trust_remote_code_without_our_package(tmp_path, target):
    """The dflash.py decision: AutoModel + trust_remote_code loads the released layout through OUR code next to it."""
    drafter = build_drafter(target, "sliding")
    export_drafter(drafter, tmp_path / "released", "released", target_name_or_path=TARGET_ID)
    target.save_pretrained(tmp_path / "target")
    prompt = random_prompt(9, seed=2)
    script = textwrap.dedent(
        f"""
        import sys, json, torch
        torch.set_num_threads(1)
        sys.modules["transformers_dflash"] = None  # as on a machine without the package
        from transformers import AutoModel, AutoModelForCausalLM
        target = AutoModelForCausalLM.from_pretrained({str(tmp_path / "target")!r})
        drafter = AutoModel.from_pretrained({str(tmp_path / "released")!r}, trust_remote_code=True, dtype="auto")
        drafter.draft_length = "full"  # "auto" (the CPU default) follows step timings: the two runs could differ
        prompt = torch.tensor({prompt.tolist()})
        plain = target.generate(prompt, max_new_tokens=16, do_sample=False)
        fast = target.generate(prompt, max_new_tokens=16, do_sample=False, assistant_model=drafter)
        print(json.dumps({{"equal": bool(torch.equal(plain, fast)), "module": type(drafter).__module__,
                          "lengths": drafter.last_acceptance_lengths,
                          "norm": drafter.norm.weight.tolist()}}))
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["equal"] and sum(report["lengths"]) == 16
    assert report["module"].startswith("transformers_modules") and report["module"].endswith("dflash")
    assert report["norm"] == drafter.norm.weight.tolist()
    drafter.draft_length = "full"
    target.generate(prompt, max_new_tokens=16, do_sample=False, assistant_model=drafter)  # same drafts as in-process
    assert drafter.last_acceptance_lengths == report["lengths"]


def test_speculators_checkpoints_written_by_speculators_also_convert(tmp_path, target):
    """What speculators itself may write: a diff-only transformer_layer_config in the transformers-5 RoPE spelling and
    the verifier-owned tensors (embed_tokens, lm_head, verifier_norm) next to the drafter's."""
    drafter = build_drafter(target, "sliding")
    folder = export_drafter(drafter, tmp_path / "spec", "speculators", target_name_or_path=TARGET_ID)
    config = json.loads((folder / "config.json").read_text())
    defaults = AutoConfig.for_model("qwen3").to_dict()
    layer = config["transformer_layer_config"]
    theta = layer.pop("rope_theta")
    layer.pop("rope_scaling")
    layer = {k: v for k, v in layer.items() if k == "model_type" or defaults.get(k, object()) != v}
    layer["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    config["transformer_layer_config"] = layer
    config.pop("num_target_layers")
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(folder / "model.safetensors")
    tensors |= {
        "embed_tokens.weight": target.get_input_embeddings().weight.detach().clone(),
        "lm_head.weight": target.get_output_embeddings().weight.detach().clone(),
        "verifier_norm.weight": torch.ones(32),
    }
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    back = convert_drafter(folder)
    assert back.config.num_target_layers is None
    assert_same_tensors(drafter, back)
    assert_same_drafts(drafter, back, target)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.update(draft_vocab_size=64), "reduced draft vocabulary"),
        (lambda c: c.update(sliding_window_non_causal=False), "causal masking"),
        (lambda c: c.update(projector_type="domino"), "Domino"),
        (lambda c: c.update(target_hidden_size=64), "target_hidden_size"),
        (lambda c: c.update(speculators_model_type="eagle3"), "only DFlash"),
        (lambda c: c.update(aux_hidden_state_layer_ids=[0, 2]), "embeddings"),
    ],
)
def test_speculators_drafters_we_cannot_represent_are_refused(tmp_path, target, edit, message):
    folder = export_drafter(build_drafter(target, "sliding"), tmp_path / "spec", "speculators", TARGET_ID)
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        convert_drafter(folder)


def test_export_refusals(tmp_path, target):
    last_layer = make_drafter(target, num_layers=1, block_size=4, target_layer_ids=[3, NUM_TARGET_LAYERS - 1])
    with pytest.raises(ValueError, match="last layer"):
        export_drafter(last_layer, tmp_path / "a", "speculators", TARGET_ID)
    export_drafter(last_layer, tmp_path / "b", "released", TARGET_ID)  # fine there: hidden_states[L] is defined
    drafter = build_drafter(target)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        export_drafter(drafter, tmp_path / "c", "hub")
    (tmp_path / "c" / "pytorch_model.bin").write_bytes(b"stale")
    export_drafter(drafter, tmp_path / "c", "hub", overwrite=True)
    assert (tmp_path / "c" / "notes.txt").is_file() and not (tmp_path / "c" / "pytorch_model.bin").exists()
    target.config.save_pretrained(tmp_path / "other-target")  # a target of 8 layers of width 32 fits, 64 does not
    export_drafter(drafter, tmp_path / "d", "released", target_name_or_path=str(tmp_path / "other-target"))
    wide = AutoConfig.for_model("qwen3", hidden_size=64, num_hidden_layers=NUM_TARGET_LAYERS)
    wide.save_pretrained(tmp_path / "wide")
    with pytest.raises(ValueError, match="hidden size"):
        export_drafter(drafter, tmp_path / "e", "released", target_name_or_path=str(tmp_path / "wide"))


# --------------------------------------------------------------------------------------------------------------------
# Safety: pickled weights


class _Marker:
    """Unpickling this creates a folder: proof that a pickle was (or was not) loaded."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.makedirs, (self.path,))


@pytest.mark.parametrize("layout", ["hub", "released", "speculators"])
def test_pickled_weights_are_refused_without_unpickling(tmp_path, target, layout, capsys):
    folder = export_drafter(build_drafter(target), tmp_path / layout, layout, TARGET_ID)
    marker = tmp_path / "unpickled"
    os.remove(folder / "model.safetensors")
    with open(folder / "pytorch_model.bin", "wb") as f:
        pickle.dump({"fc.weight": _Marker(str(marker))}, f)
    with pytest.raises(ValueError, match="pickled weights"):
        convert_drafter(folder)
    with pytest.raises(SystemExit, match="safetensors only"):
        cli_main(["convert", str(folder), "--out", str(tmp_path / "out")])
    assert not marker.exists()
    if layout == "hub":  # next to safetensors, a pickle is ignored (never loaded)
        export_drafter(build_drafter(target), tmp_path / "both", layout)
        shutil.copy(folder / "pytorch_model.bin", tmp_path / "both" / "pytorch_model.bin")
        with pytest.warns(UserWarning, match="ignored pickled"):
            convert_drafter(tmp_path / "both")
        assert not marker.exists()


# --------------------------------------------------------------------------------------------------------------------
# push_to_hub against a local folder


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """huggingface_hub's upload calls write into tmp_path/hub/<org>--<name> instead of the network; README downloads
    (transformers loads a repo's existing card on push) read from there."""
    import huggingface_hub
    import huggingface_hub.repocard
    import transformers.utils.hub as transformers_hub
    from huggingface_hub.errors import EntryNotFoundError

    root = tmp_path / "hub"
    monkeypatch.chdir(tmp_path)  # transformers 4 pushes from ./<repo name> when such a folder exists

    def repo_dir(repo_id):
        return root / repo_id.replace("/", "--")

    def repo_id_of(args, kwargs):
        return kwargs.get("repo_id") or next(a for a in args if isinstance(a, str))

    def create_repo(*args, **kwargs):
        repo_id = repo_id_of(args, kwargs)
        repo_dir(repo_id).mkdir(parents=True, exist_ok=True)
        return SimpleNamespace(repo_id=repo_id, url=f"https://huggingface.co/{repo_id}")

    def create_commit(*args, operations, **kwargs):
        repo = repo_dir(repo_id_of(args, kwargs))
        for op in operations:
            dest = repo / op.path_in_repo
            dest.parent.mkdir(parents=True, exist_ok=True)
            source = op.path_or_fileobj
            if isinstance(source, (str, Path)):
                shutil.copyfile(source, dest)
            else:
                dest.write_bytes(source if isinstance(source, bytes) else source.read())
        return SimpleNamespace(commit_url="local", oid="0" * 40)

    def upload_folder(*args, folder_path, **kwargs):
        shutil.copytree(folder_path, repo_dir(repo_id_of(args, kwargs)), dirs_exist_ok=True)
        return SimpleNamespace(commit_url="local", oid="0" * 40)

    def hf_hub_download(repo_id, filename, **kwargs):
        path = repo_dir(repo_id) / filename
        if not path.is_file():
            raise EntryNotFoundError(f"{filename} not in {repo_id}")
        return str(path)

    for name, fn in (("create_repo", create_repo), ("create_commit", create_commit), ("upload_folder", upload_folder)):
        monkeypatch.setattr(huggingface_hub.HfApi, name, lambda self, *a, _fn=fn, **k: _fn(*a, **k))
        if hasattr(transformers_hub, name):  # transformers 4 calls the module-level functions
            monkeypatch.setattr(transformers_hub, name, fn)
    monkeypatch.setattr(huggingface_hub.repocard, "hf_hub_download", hf_hub_download)
    return repo_dir


def test_push_to_hub_uploads_code_weights_and_card(fake_hub, target):
    drafter = build_drafter(target)
    drafter.push_to_hub("me/fresh-drafter")  # exactly as for any transformers model
    repo = fake_hub("me/fresh-drafter")
    assert {"config.json", "model.safetensors", "README.md", *CODE_FILES} <= set(os.listdir(repo))
    check_hub_schema(repo)
    check_code_files(repo)
    assert_same_tensors(drafter, DFlashDraftModel.from_pretrained(repo, dtype="auto"))

    # our card: push_drafter_to_hub uploads the full export; later push_to_hub calls keep the card
    push_drafter_to_hub(
        drafter,
        "me/carded-drafter",
        target_name_or_path=TARGET_ID,
        card_metadata={"data": "800 regenerated prompts", "steps": 42, "acceptance_length": 3.25},
    )
    repo = fake_hub("me/carded-drafter")
    card = check_card(repo, TARGET_ID)
    assert "800 regenerated prompts" in card.text and "3.25" in card.text
    assert 'AutoModel.from_pretrained("me/carded-drafter", trust_remote_code=True' in card.text
    drafter.push_to_hub("me/carded-drafter")
    assert check_card(repo, TARGET_ID).text == card.text
    check_hub_schema(repo)


# --------------------------------------------------------------------------------------------------------------------
# CLI and model cards


def test_cli_export_and_convert(tmp_path, target):
    drafter = build_drafter(target)
    train_dir = tmp_path / "run"
    drafter.save_pretrained(train_dir)  # what `dflash train` leaves, with its log
    (train_dir / "log.jsonl").write_text(
        json.dumps({"step": 500, "loss": 1.0}) + "\n" + json.dumps({"step": 500, "val_acceptance_length": 1.75}) + "\n"
    )
    (tmp_path / "card.json").write_text(json.dumps({"data": "1K prompts regenerated by the target", "license": "mit"}))
    assert (
        cli_main(
            [
                "export",
                "--layout",
                "speculators",
                "--target",
                TARGET_ID,
                "--card",
                str(tmp_path / "card.json"),
                "--out",
                str(tmp_path / "spec"),
                str(train_dir),
            ]
        )
        == 0
    )
    check_speculators_schema(tmp_path / "spec", drafter, TARGET_ID)
    card = check_card(tmp_path / "spec", TARGET_ID)
    assert card.data.license == "mit" and "500" in card.text and "1.75" in card.text and "1K prompts" in card.text
    # convert back to our layout: the verifier becomes the card's base_model, metadata carried over
    assert cli_main(["convert", str(tmp_path / "spec"), "--out", str(tmp_path / "hub")]) == 0
    check_hub_schema(tmp_path / "hub")
    assert check_card(tmp_path / "hub", TARGET_ID).data.license == "mit"
    assert_same_tensors(drafter, convert_drafter(tmp_path / "hub"))
    with pytest.raises(SystemExit, match="not empty"):
        cli_main(["convert", str(tmp_path / "spec"), "--out", str(tmp_path / "hub")])


def test_model_card_template_and_metadata():
    assert cards.TEMPLATE_PATH.is_file()
    assert cards.BUILTIN_TEMPLATE == cards.TEMPLATE_PATH.read_text(encoding="utf-8")
    drafter = build_drafter(make_target("qwen3", num_layers=NUM_TARGET_LAYERS))
    config = drafter.config
    text = cards.render_model_card(
        config,
        {"target": "Qwen/Qwen3-8B", "datasets": "my/data", "tau": 6.49, "speedup": 4.86, "tags": ["qwen3"]},
        layout="released",
    )
    from huggingface_hub import ModelCard

    data = ModelCard(text).data.to_dict()
    assert data == {
        "base_model": "Qwen/Qwen3-8B",
        "datasets": ["my/data"],
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["dflash", "speculative-decoding", "qwen3"],
    }
    assert "6.49" in text and "4.86x" in text and "--speculative-algorithm DFLASH" in text
    assert f"| Parameters | {sum(p.numel() for p in drafter.parameters()):,} |" in text
    assert "{{" not in text
    note = "This copy holds config, weights and card only."
    assert "\n\n" + note + "\n\n## Safety" in cards.render_model_card(config, {"files_note": note})
    assert note not in text
    with pytest.raises(ValueError, match="Unknown model-card metadata"):
        cards.render_model_card(config, {"stpes": 3})


def test_model_card_says_how_the_drafter_was_trained(tmp_path):
    """The card's recipe names the loss the training log records: cross-entropy alone, or mixed with KL."""
    config = build_drafter(make_target("qwen3", num_layers=NUM_TARGET_LAYERS)).config
    log = tmp_path / "log.jsonl"
    records = [{"event": "start", "step": 0, "config": {"kl_weight": 0.5}}, {"step": 40, "loss": 1.0}]
    log.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    found = cards.metadata_from_training_dir(tmp_path)
    assert found == {"steps": 40, "kl_weight": 0.5}
    assert "mixing cross-entropy with KL divergence to the target's most likely tokens (share 0.5)" in (
        cards.render_model_card(config, found)
    )
    records[0]["config"]["kl_weight"] = 0.0  # as every log before distillation became the default says
    log.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    text = cards.render_model_card(config, cards.metadata_from_training_dir(tmp_path))
    assert "a position-decayed cross-entropy; the target" in text and "KL" not in text
