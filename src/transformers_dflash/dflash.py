"""The entry point of the carried core: the module a checkpoint's `auto_map` names (`dflash.DFlashDraftModel`).

`AutoModel.from_pretrained(folder, trust_remote_code=True)` imports this file from the checkpoint folder. It imports
every other core file directly, because transformers 4.x copies only the files its entry point imports when it loads
a local folder; `code_files.py` reads the list of carried files from here. Importing it installs the generation hook,
so that `target.generate(input_ids, assistant_model=drafter)` drafts with DFlash.

The released DFlash checkpoints name the same entry point; their config.json says `model_type: "qwen3"`, which
`DFlashDraftModel.from_pretrained` re-reads as a `DFlashConfig`. The DFlash authors' own folders carry their own
`dflash.py`: an instance of that class passed as `assistant_model` is adopted by the generation hook
(`DFlashDraftModel.from_released_model`, same weights), and one of those folders loaded without its code (a plain
`Qwen3Model`) is refused there with the call to make instead.
"""

from .candidate_generator import DFlashCandidateGenerator
from .code_files import code_files, write_code_files
from .configuration_dflash import DFlashConfig
from .decoding import dflash_decoding
from .draft_length import AutoDraftLength, ConfidenceThreshold, FullBlock, draft_length_policy
from .generation_hook import install_generation_hook
from .kernel_choices import choices_folder
from .kernels import cpu_kernels, packed_gqa_attention, skinny_linear, skinny_linears
from .modeling_dflash import DFlashDrafterCache, DFlashDraftModel
from .ngram_lookup import NgramLookup
from .prefill import grouped_prefill, prefill_groups
from .state_rollback import StateRollback, check_state_rollback
from .target_model import check_drafter_fits_target, text_config
from .verification import accept_lengths, choose_tokens, process_logits, stop_lengths

install_generation_hook(DFlashDraftModel)

__all__ = [
    "AutoDraftLength",
    "ConfidenceThreshold",
    "DFlashCandidateGenerator",
    "DFlashConfig",
    "DFlashDraftModel",
    "DFlashDrafterCache",
    "FullBlock",
    "NgramLookup",
    "StateRollback",
    "accept_lengths",
    "check_drafter_fits_target",
    "check_state_rollback",
    "choices_folder",
    "choose_tokens",
    "code_files",
    "cpu_kernels",
    "dflash_decoding",
    "draft_length_policy",
    "grouped_prefill",
    "install_generation_hook",
    "packed_gqa_attention",
    "prefill_groups",
    "process_logits",
    "skinny_linear",
    "skinny_linears",
    "stop_lengths",
    "text_config",
    "write_code_files",
]
