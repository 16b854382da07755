"""Shards of regenerated data: Parquet and `.pt` shards, reading and checking them, the manifest, atomic writes."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from .errors import DataError, DiskFullError, ShardCorruptedError

logger = logging.getLogger(__name__)


SHARD_FORMATS = ("parquet", "pt")
DEFAULT_SHARD_FORMAT = "parquet"
SHARD_NAME = "shard-{:05d}.pt"  # the original format (torch.save); still read everywhere
PARQUET_SHARD_NAME = "shard-{:05d}.parquet"
SHARD_RE = re.compile(r"^shard-(\d{5,})\.(pt|parquet)$")
PARQUET_INSTALL = "pip install pyarrow"
MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "dflash-regenerated"
FORMAT_VERSION = 1


def _delete_hint(path: Path) -> str:
    if (path.parent / "features.json").exists():  # a `dflash features` folder (training/features.py writes it)
        return (
            f"Delete {path} and rerun the same `dflash features` command: only the missing shards are computed, "
            "finished ones are kept."
        )
    return (
        f"Delete {path} and rerun the same `dflash regenerate` command: only the missing shards are regenerated, "
        "finished ones are kept."
    )


def _check_records(records: Any, path: Path) -> list[dict]:
    if not isinstance(records, list):
        raise ShardCorruptedError(f"Shard {path} does not hold a list of examples. {_delete_hint(path)}")
    for i, rec in enumerate(records):
        ok = (
            isinstance(rec, dict)
            and isinstance(rec.get("input_ids"), torch.Tensor)
            and isinstance(rec.get("loss_mask"), torch.Tensor)
        )
        if ok:
            ids, mask = rec["input_ids"], rec["loss_mask"]
            ok = (
                ids.dim() == 1
                and mask.dim() == 1
                and ids.shape == mask.shape
                and ids.dtype == torch.long
                and mask.dtype == torch.bool
                and bool(mask.any())
            )
        if not ok:
            raise ShardCorruptedError(
                f"Shard {path}: example {i} is malformed (expected input_ids LongTensor[L] and "
                f"loss_mask BoolTensor[L] with response tokens). {_delete_hint(path)}"
            )
    return records


def _import_pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise DataError(
            f"Parquet shards need pyarrow, which is not installed. Install it with:\n    {PARQUET_INSTALL}\n"
            "(or `pip install transformers-dflash[train]`), or write the original format with "
            "--format pt."
        ) from None
    return pyarrow


def shard_to_parquet_bytes(records: Sequence[dict], prompt_indices: Sequence[int] | None = None) -> bytes:
    """A shard as Parquet bytes: columns ``input_ids`` (list<int32>), ``loss_mask`` (list<bool>) and, when given,
    ``prompt_index`` (int64, the example's index in the regenerated prompt list). Readable by
    ``datasets.load_dataset("parquet", data_files=...)``."""
    pa = _import_pyarrow()
    columns = {
        "input_ids": pa.array([r["input_ids"].tolist() for r in records], type=pa.list_(pa.int32())),
        "loss_mask": pa.array([r["loss_mask"].tolist() for r in records], type=pa.list_(pa.bool_())),
    }
    if prompt_indices is not None:
        columns["prompt_index"] = pa.array([int(i) for i in prompt_indices], type=pa.int64())
    buf = io.BytesIO()
    pa.parquet.write_table(pa.table(columns), buf, compression="zstd")
    return buf.getvalue()


def _list_column(table: Any, name: str, dtype: torch.dtype, path: Path) -> list[torch.Tensor]:
    """A list<...> column of a Parquet table as one tensor per row (no per-element Python conversion)."""
    import numpy as np

    column = table.column(name).combine_chunks()
    if column.null_count:
        raise ShardCorruptedError(f"Shard {path}: column '{name}' has missing rows. {_delete_hint(path)}")
    offsets = column.offsets.to_numpy()
    values = column.values.to_numpy(zero_copy_only=False)
    flat = torch.from_numpy(np.array(values)).to(dtype)  # a writable copy
    sizes = (offsets[1:] - offsets[:-1]).tolist()
    # clones, not views: a saved example must not carry the whole shard's storage with it
    return [t.clone() for t in torch.split(flat[offsets[0] : offsets[-1]], sizes)] if sizes else []


def _parquet_records(data: bytes, path: Path) -> list[dict]:
    pa = _import_pyarrow()
    try:
        table = pa.parquet.read_table(pa.BufferReader(data))
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for damaged files
        raise ShardCorruptedError(
            f"Shard {path} is not a readable Parquet file ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}). {_delete_hint(path)}"
        ) from e
    expected = {"input_ids": pa.list_(pa.int32()), "loss_mask": pa.list_(pa.bool_())}
    for name, kind in expected.items():
        field_ = table.schema.field(name) if name in table.schema.names else None
        if field_ is None or not (pa.types.is_list(field_.type) or pa.types.is_large_list(field_.type)):
            raise ShardCorruptedError(
                f"Shard {path} lacks the column '{name}' ({kind}); columns: {table.schema.names}. {_delete_hint(path)}"
            )
    ids = _list_column(table, "input_ids", torch.long, path)
    masks = _list_column(table, "loss_mask", torch.bool, path)
    return [{"input_ids": i, "loss_mask": m} for i, m in zip(ids, masks)]


def load_shard(path: str | os.PathLike, expected_sha256: str | None = None) -> list[dict]:
    """Load one shard written by :func:`regenerate` (``.parquet`` or the original ``.pt``) and check it.

    Returns a list of ``{"input_ids": LongTensor[L], "loss_mask": BoolTensor[L]}`` whatever the file format. Raises
    :class:`ShardCorruptedError` naming the file (and telling to delete it) if it is truncated, unreadable,
    malformed, or differs from the checksum recorded in the manifest.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ShardCorruptedError(f"Shard {path} cannot be read ({e}). {_delete_hint(path)}") from e
    if expected_sha256 is not None and hashlib.sha256(data).hexdigest() != expected_sha256:
        raise ShardCorruptedError(
            f"Shard {path} does not match the checksum in {MANIFEST_NAME} (partial or modified "
            f"file). {_delete_hint(path)}"
        )
    if path.suffix == ".parquet":
        return _check_records(_parquet_records(data, path), path)
    try:
        records = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for truncated zip archives / pickles
        raise ShardCorruptedError(
            f"Shard {path} is corrupted or incomplete ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}). {_delete_hint(path)}"
        ) from e
    return _check_records(records, path)


def read_manifest(data_dir: str | os.PathLike) -> dict | None:
    path = Path(data_dir) / MANIFEST_NAME
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(
            f"{path} is unreadable ({e}). Delete it and rerun `dflash regenerate` with the same "
            "arguments: existing shards are checked and kept."
        ) from e


def list_shards(data_dir: str | os.PathLike) -> list[Path]:
    """Shard files (``shard-XXXXX.parquet`` or ``.pt``) of a regenerated data directory, in shard order."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"{data_dir} is not a directory of regenerated data (run `dflash regenerate` first)")
    found = sorted((int(m.group(1)), p) for p in data_dir.iterdir() if (m := SHARD_RE.match(p.name)))
    for (a, pa_), (b, pb) in zip(found, found[1:]):
        if a == b:
            raise DataError(f"{data_dir} holds shard {a} twice ({pa_.name} and {pb.name}). Delete one of them.")
    return [p for _, p in found]


def iter_regenerated_examples(data_dir: str | os.PathLike, verify: bool = True) -> Iterator[dict]:
    """Yield ``{"input_ids", "loss_mask"}`` examples of every shard in order (checksums verified against the manifest
    when `verify`). Warns when the directory is incomplete."""
    manifest = read_manifest(data_dir)
    shard_info = (manifest or {}).get("shards", {})
    if manifest is not None and not manifest.get("complete", False):
        logger.warning(
            "%s: regeneration is incomplete (%s of %s shards); using the finished shards",
            data_dir,
            manifest.get("shards_done"),
            manifest.get("num_shards"),
        )
    for path in list_shards(data_dir):
        info = shard_info.get(path.stem.split("-")[1]) if verify else None
        yield from load_shard(path, expected_sha256=info.get("sha256") if info else None)


def disk_full_error(what: str, finished: int) -> DiskFullError:
    """`what` ran out of disk: the shards finished so far are intact and the same command resumes."""
    return DiskFullError(
        errno.ENOSPC,
        f"{what} The {finished} shard(s) finished so far are intact. Free some space (or use --out on a bigger disk) "
        "and rerun the same command to resume.",
    )


def write_atomically(path: Path, data: bytes, what: str, finished: int) -> None:
    """Write `data` to `path` whole or not at all (a .tmp, fsynced, then renamed); a full disk is a DiskFullError."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise disk_full_error(f"Disk full while writing {what} {path}.", finished) from e
        raise
