"""Interop: write a DFlash drafter in the layouts that the Hub, SGLang and vLLM read, and read any of them back.

    from transformers_dflash.interop import convert_drafter, export_drafter
    export_drafter(drafter, "out/released", "released", target_name_or_path="Qwen/Qwen3-8B")
    drafter = convert_drafter("out/released")            # any layout, detected from config.json

    dflash export --layout {hub,released,speculators} --out DIR DRAFTER
    dflash convert SRC --out DIR [--layout hub]

The three layouts (every one stores the weights as ONE `model.safetensors` with the same tensor names,
`layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `layers.{i}.self_attn.{q,k}_norm.weight`,
`layers.{i}.mlp.{gate,up,down}_proj.weight`, `layers.{i}.{input,post_attention}_layernorm.weight`, `fc.weight`,
`hidden_norm.weight`, `norm.weight`; only config.json and the files next to it differ):

1. `hub`: what `DFlashDraftModel.save_pretrained` writes (config.json with `model_type: "dflash"` and `auto_map`, the
   self-contained core files, `code_files`) plus a model card README.md; ready for `drafter.push_to_hub`, `hf upload` /
   `huggingface-cli upload`, and `AutoModel.from_pretrained(..., trust_remote_code=True)`.
2. `released`: the layout of the released DFlash checkpoints (`model_type: "qwen3"` + `dflash_config`), which SGLang
   and vLLM load with their own implementation (`released.py`).
3. `speculators`: the vLLM speculators format (`speculators_model_type: "dflash"`), which `vllm serve` reads
   directly (`speculators.py`, with the sources of its schema).

Reading is strict: a layout is detected from config.json; only safetensors are read (pickled `.bin`/`.pt` files are
refused with a clear message, never unpickled); no code from the folder is ever run (the installed classes are used);
missing, unexpected or mis-shaped tensors raise. What DFlash-here cannot represent is refused rather than approximated:
a speculators reduced draft vocabulary (own lm_head + d2t), a hidden size different from the target's, causal
sliding-window blocks, Domino heads. Our own reduced draft vocabulary (`draft_vocab_ids`, rows of the target's LM head)
exports to the hub layout only; the released and speculators exports refuse it.

One module per format or concern: `layouts` (names, detection), `target` (what an export needs to know about the
target), `weights` (safetensors only), `released`, `speculators` (each format's config.json, both ways), `export`
(writing), `hub` (uploading), `convert` (reading), `check` (the schema checks). The commands are in
`transformers_dflash.cli.export` and `.convert`.
"""

from ..model_card import CardMetadata
from .check import check_layout, code_import_problems
from .convert import card_info, convert_drafter
from .export import export_drafter
from .hub import push_drafter_to_hub
from .layouts import LAYOUTS, detect_layout
from .released import released_config
from .speculators import speculators_config, speculators_to_dflash_config
from .target import TargetInfo, target_info
from .weights import expected_tensor_names

__all__ = [
    "LAYOUTS",
    "CardMetadata",
    "TargetInfo",
    "card_info",
    "check_layout",
    "code_import_problems",
    "convert_drafter",
    "detect_layout",
    "expected_tensor_names",
    "export_drafter",
    "push_drafter_to_hub",
    "released_config",
    "speculators_config",
    "speculators_to_dflash_config",
    "target_info",
]
