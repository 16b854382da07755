"""transformers-dflash: DFlash block-diffusion speculative decoding for Hugging Face transformers.

Importing the package registers the `dflash` model type with the Auto classes and installs the generation hook, so
`target.generate(input_ids, assistant_model=drafter)` drafts with DFlash.

The carried core (what a checkpoint holds next to its weights, see `code_files.py`) is the flat set of files that
`dflash.py` imports; everything else (data, training, bench, interop, cli) depends on it, never the reverse.

The names below are resolved on first use (PEP 562), so that modules that do not need torch (the command line's
parser, `runtime`, `smollm2`) import without it. The `dflash` command is the one importer that also defers the
registration: it calls `register()` when a command runs, so that `dflash --help` waits for neither torch nor
transformers.
"""

import importlib
import os
import sys

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "DFlashCandidateGenerator": "dflash",
    "DFlashConfig": "dflash",
    "DFlashDraftModel": "dflash",
    "DFlashDrafterCache": "dflash",
    "cpu_kernels": "dflash",
    "dflash_decoding": "dflash",
    "packed_gqa_attention": "dflash",
    "skinny_linear": "dflash",
    "skinny_linears": "dflash",
    "SHIPPED_DRAFTER": "smollm2",
    "load_smollm2": "smollm2",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def register() -> None:
    """Register the `dflash` model type with the Auto classes and install the generation hook (importing the core
    installs it). Importing the package does this; calling it again changes nothing."""
    from transformers import AutoConfig, AutoModel

    from .dflash import DFlashConfig, DFlashDraftModel

    AutoConfig.register("dflash", DFlashConfig, exist_ok=True)
    AutoModel.register(DFlashConfig, DFlashDraftModel, exist_ok=True)


def _imported_by_the_dflash_command() -> bool:
    """True when the process is the `dflash` console script, which imports this package on its way to `cli.main`."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None) or ""
    return os.path.basename(main_file) == "dflash"


if not _imported_by_the_dflash_command():
    register()
