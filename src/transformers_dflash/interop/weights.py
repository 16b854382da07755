"""The weights: one `model.safetensors` with the same tensor names in every layout; pickled files are refused."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch

from ..configuration_dflash import DFlashConfig
from .layouts import PICKLE_SUFFIXES, WEIGHTS_INDEX_NAME, WEIGHTS_NAME


def state_dict_for_safetensors(drafter: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().to("cpu").contiguous() for name, tensor in drafter.state_dict().items()}


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})  # transformers expects format "pt"


def expected_tensor_names(config: DFlashConfig) -> set[str]:
    """The tensor names of a DFlash drafter with `config`, in every layout."""
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        names |= {p + f"self_attn.{m}_proj.weight" for m in "qkvo"}
        names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
        names |= {p + f"mlp.{m}_proj.weight" for m in ("gate", "up", "down")}
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        if getattr(config, "attention_bias", False):
            names |= {p + f"self_attn.{m}_proj.bias" for m in "qkvo"}
    if getattr(config, "draft_vocab_size", None) is not None:
        names.add("draft_vocab_ids")  # reduced draft vocabulary (hub layout only)
    return names


def weight_files(folder: Path) -> tuple[list[Path], list[str]]:
    """The safetensors files holding the weights, refusing pickled checkpoints (returns the files and warnings)."""
    names = sorted(os.listdir(folder))
    pickled = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
    index = folder / WEIGHTS_INDEX_NAME
    if (folder / WEIGHTS_NAME).is_file():
        files = [folder / WEIGHTS_NAME]
    elif index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        files = [folder / n for n in names if n.endswith(".safetensors")]
    if not files:
        if pickled:
            raise ValueError(
                f"{folder} holds only pickled weights ({', '.join(pickled)}). DFlash checkpoints are read from "
                "safetensors only: loading a pickle can run arbitrary code. If you trust the file, convert it "
                "separately, e.g. safetensors.torch.save_file(torch.load(path, weights_only=True), "
                "'model.safetensors'), and try again."
            )
        raise ValueError(f"No model.safetensors in {folder}.")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"{folder} lacks the safetensors shards {missing} named by its index.")
    notes = [f"ignored pickled files {pickled} (only safetensors are read)"] if pickled else []
    return files, notes


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files, notes = weight_files(folder)
    for note in notes:
        warnings.warn(f"{folder}: {note}", stacklevel=3)
    tensors = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors


def weight_shapes(folder: Path) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """{tensor name: shape} of the folder's safetensors (read from headers only) and the problems found."""
    from safetensors import safe_open

    files, problems = weight_files(folder)
    shapes = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes, problems
