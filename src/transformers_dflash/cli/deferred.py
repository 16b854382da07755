"""`dflash regenerate`, `dflash features` and `dflash train`: thin wrappers around `transformers_dflash.data` and
`transformers_dflash.training`, which define their options and run them. Those modules import torch and transformers,
so they are imported only when one of these commands is parsed or run, never for `dflash --help`."""

from __future__ import annotations

import importlib


def _deferred(module: str, name: str):
    """`module.name`, imported on the first call."""

    def call(*args):
        return getattr(importlib.import_module(module, __package__), name)(*args)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"`transformers_dflash{module[1:]}.{name}`, imported when called."
    return call


add_regenerate_arguments = _deferred("..data", "add_regenerate_arguments")
run_regenerate = _deferred("..data", "run_regenerate")
add_features_arguments = _deferred("..training", "add_features_arguments")
run_features = _deferred("..training", "run_features")
add_train_arguments = _deferred("..training", "add_train_arguments")
run_train = _deferred("..training", "run_train")
