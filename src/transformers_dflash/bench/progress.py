"""A tqdm progress bar on stderr when asked for and installed, else one that does nothing."""

from __future__ import annotations

import sys


class _NoProgress:
    def __init__(self, *args, **kwargs):
        pass

    def update(self, n=1):
        pass

    def set_postfix_str(self, text):
        pass

    def close(self):
        pass


def progress_bar(enabled: bool, total: int):
    if not enabled:
        return _NoProgress()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _NoProgress()
    return tqdm(total=total, desc="dflash bench", unit="run", dynamic_ncols=True, file=sys.stderr)
