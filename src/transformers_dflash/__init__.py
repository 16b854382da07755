"""transformers-dflash: DFlash block-diffusion speculative decoding for Hugging Face transformers.

Importing the package registers the `dflash` model type with the Auto classes and installs the generation hook, so
`target.generate(input_ids, assistant_model=drafter)` drafts with DFlash.

The carried core (what a checkpoint holds next to its weights, see `code_files.py`) is the flat set of files that
`dflash.py` imports; everything else (data, training, bench, interop, cli) depends on it, never the reverse.
"""

from transformers import AutoConfig, AutoModel

from .dflash import (
    DFlashCandidateGenerator,
    DFlashConfig,
    DFlashDrafterCache,
    DFlashDraftModel,
    cpu_kernels,
    dflash_decoding,
    packed_gqa_attention,
    skinny_linear,
    skinny_linears,
)

from .smollm2 import SHIPPED_DRAFTER, load_smollm2

__version__ = "0.1.0"

AutoConfig.register("dflash", DFlashConfig, exist_ok=True)
AutoModel.register(DFlashConfig, DFlashDraftModel, exist_ok=True)

__all__ = [
    "SHIPPED_DRAFTER",
    "DFlashCandidateGenerator",
    "DFlashConfig",
    "DFlashDraftModel",
    "DFlashDrafterCache",
    "cpu_kernels",
    "dflash_decoding",
    "load_smollm2",
    "packed_gqa_attention",
    "skinny_linear",
    "skinny_linears",
]
