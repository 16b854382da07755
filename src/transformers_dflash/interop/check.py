"""Checks of a written folder against its layout's documented schema: config keys and types, files, tensor names and
shapes, and the imports of the code files next to the weights."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..code_files import HUB_AUTO_MAP, RELEASED_AUTO_MAP
from .convert import dflash_config_from_folder
from .layouts import CODE_FILES, CONFIG_NAME, detect_layout, read_config
from .weights import expected_tensor_names, weight_shapes

# The documented schemas: key -> allowed JSON types. `check_layout` checks an exported folder against them.
_NUM = (int, float)
_OPT_INT = (int, type(None))
RELEASED_CONFIG_SCHEMA = {  # shared/docs/dflash-spec.md, "Released checkpoint config.json"
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
    "rms_norm_eps": _NUM,
    "rope_theta": _NUM,
    "rope_scaling": (dict, type(None)),
    "max_position_embeddings": int,
    "attention_bias": bool,
    "attention_dropout": _NUM,
    "layer_types": list,
    "sliding_window": _OPT_INT,
    "use_sliding_window": bool,
    "max_window_layers": int,
    "tie_word_embeddings": bool,
    "vocab_size": int,
    "bos_token_id": _OPT_INT,
    "eos_token_id": (int, list, type(None)),
    "dtype": str,
    "initializer_range": _NUM,
}
SPECULATORS_CONFIG_SCHEMA = {  # src/speculators/config.py + src/speculators/models/dflash/config.py
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
SPECULATORS_ALGORITHM_SCHEMA = {  # SpeculatorsConfig
    "algorithm": str,
    "proposal_methods": list,
    "default_proposal_method": str,
    "verifier": dict,
}
HUB_CONFIG_SCHEMA = {
    "model_type": str,
    "auto_map": dict,
    "architectures": list,
    "block_size": int,
    "mask_token_id": int,
    "target_layer_ids": list,
    "dflash_config": dict,
}


def _check_types(content: dict, schema: dict, where: str) -> list[str]:
    problems = []
    for key, types in schema.items():
        if key not in content:
            problems.append(f"{where}: missing key {key!r}")
        elif not isinstance(content[key], types) or (types is int and isinstance(content[key], bool)):
            problems.append(f"{where}: {key!r} is {type(content[key]).__name__}, expected {types}")
    return problems


def check_layout(folder: str | os.PathLike, layout: str | None = None) -> list[str]:
    """Problems of `folder` as a checkpoint in `layout` (detected when None): required config keys and their types,
    the files the layout needs, exactly the DFlash tensor names with the right shapes, no pickled weights, and the code
    files importing only torch and transformers. An empty list means the folder matches its documented schema."""
    folder = Path(folder)
    layout = layout or detect_layout(folder)
    content = read_config(folder)
    problems: list[str] = []
    if layout == "released":
        problems += _check_types(content, RELEASED_CONFIG_SCHEMA, CONFIG_NAME)
        if content.get("architectures") != ["DFlashDraftModel"]:
            problems.append("architectures must be ['DFlashDraftModel']")
        if content.get("auto_map") != RELEASED_AUTO_MAP:
            problems.append(f"auto_map must be {RELEASED_AUTO_MAP}")
        if content.get("model_type") != "qwen3":
            problems.append("model_type must be 'qwen3'")
        problems += _check_types(
            content.get("dflash_config") or {}, {"mask_token_id": int, "target_layer_ids": list}, "dflash_config"
        )
        needed = [CONFIG_NAME, *CODE_FILES]
    elif layout == "speculators":
        problems += _check_types(content, SPECULATORS_CONFIG_SCHEMA, CONFIG_NAME)
        algorithm = content.get("speculators_config") or {}
        problems += _check_types(algorithm, SPECULATORS_ALGORITHM_SCHEMA, "speculators_config")
        if content.get("speculators_model_type") != "dflash" or algorithm.get("algorithm") != "dflash":
            problems.append("speculators_model_type and speculators_config.algorithm must be 'dflash'")
        methods = algorithm.get("proposal_methods") or [{}]
        problems += _check_types(methods[0], {"proposal_type": str, "speculative_tokens": int}, "proposal_methods[0]")
        if algorithm.get("default_proposal_method") not in [m.get("proposal_type") for m in methods]:
            problems.append("default_proposal_method must be the proposal_type of one of proposal_methods")
        problems += _check_types(
            algorithm.get("verifier") or {}, {"name_or_path": (str, type(None)), "architectures": list}, "verifier"
        )
        needed = [CONFIG_NAME]
    else:
        problems += _check_types(content, HUB_CONFIG_SCHEMA, CONFIG_NAME)
        auto_map = content.get("auto_map") or {}
        if auto_map != HUB_AUTO_MAP:
            problems.append(f"auto_map must be {HUB_AUTO_MAP}: {auto_map}")
        needed = [CONFIG_NAME, *CODE_FILES]
    problems += [f"missing file {name}" for name in needed if not (folder / name).is_file()]
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            problems += [f"{name}: {p}" for p in code_import_problems(folder / name)]
    if problems:
        return problems
    try:
        config = dflash_config_from_folder(folder, layout, content)
    except ValueError as error:
        return [f"{CONFIG_NAME} does not read as a DFlash drafter config: {error}"]
    shapes, weight_problems = weight_shapes(folder)
    problems += weight_problems
    expected = expected_tensor_names(config)
    if set(shapes) != expected:
        problems.append(
            f"tensor names differ from the DFlash layout: missing {sorted(expected - set(shapes))[:5]}, "
            f"unexpected {sorted(set(shapes) - expected)[:5]}"
        )
    fc_in = len(config.target_layer_ids) * config.hidden_size
    if shapes.get("fc.weight") not in (None, (config.hidden_size, fc_in)):
        problems.append(f"fc.weight has shape {shapes['fc.weight']}, expected {(config.hidden_size, fc_in)}")
    return problems


# Code next to a checkpoint may import torch, transformers, the standard library and its sibling files: nothing a
# machine with transformers installed could lack.
ALLOWED_CODE_IMPORTS = {"torch", "transformers"} | set(sys.stdlib_module_names)


def code_import_problems(path: str | os.PathLike) -> list[str]:
    """Imports of a code file other than torch, transformers, the standard library and its sibling files."""
    import ast

    path = Path(path)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots = [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: must be a sibling file
                module = (node.module or "").split(".")[0]
                if module and not (path.parent / f"{module}.py").is_file():
                    problems.append(f"line {node.lineno}: relative import of missing file {module}.py")
                continue
            roots = [(node.module or "").split(".")[0]]
        else:
            continue
        problems += [f"line {node.lineno}: imports {root}" for root in roots if root not in ALLOWED_CODE_IMPORTS]
    return problems
