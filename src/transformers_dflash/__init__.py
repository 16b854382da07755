"""transformers-dflash: DFlash block-diffusion speculative decoding for Hugging Face transformers.

Importing the package registers the `dflash` model type with the Auto classes and installs the generation hook, so
`target.generate(input_ids, assistant_model=drafter)` drafts with DFlash.
"""

from transformers import AutoConfig, AutoModel

from .configuration_dflash import DFlashConfig
from .generation_dflash import (
    DFlashCandidateGenerator,
    DFlashDrafterCache,
    cpu_kernels,
    dflash_decoding,
    packed_gqa_attention,
    skinny_linear,
    skinny_linears,
)
from .modeling_dflash import DFlashDraftModel

__version__ = "0.1.0"

AutoConfig.register("dflash", DFlashConfig, exist_ok=True)
AutoModel.register(DFlashConfig, DFlashDraftModel, exist_ok=True)

__all__ = [
    "DFlashCandidateGenerator",
    "DFlashConfig",
    "DFlashDraftModel",
    "DFlashDrafterCache",
    "cpu_kernels",
    "dflash_decoding",
    "packed_gqa_attention",
    "skinny_linear",
    "skinny_linears",
]
