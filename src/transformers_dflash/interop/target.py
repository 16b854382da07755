"""What an export needs to know about the target, and the check that the drafter fits it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..configuration_dflash import DFlashConfig
from ..target_model import text_config


@dataclass
class TargetInfo:
    """What export needs to know about the target: its name (card `base_model`, speculators verifier) and, when its
    config can be read locally, its architectures, depth and hidden size."""

    name: str | None = None
    architectures: list[str] = field(default_factory=list)
    num_layers: int | None = None
    hidden_size: int | None = None


def target_info(target) -> TargetInfo:
    """`target`: None, a Hub id / path (its config is read from disk or the local cache only, never downloaded), a
    model or a config."""
    if target is None:
        return TargetInfo()
    config, name = None, None
    if isinstance(target, (str, os.PathLike)):
        name = str(target)
        try:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(name, local_files_only=True)
        except Exception:  # noqa: BLE001 - not available offline: the name alone still serves
            config = None
    else:
        config = getattr(target, "config", target)
        name = getattr(config, "_name_or_path", None) or getattr(target, "name_or_path", None) or None
    if config is None:
        return TargetInfo(name=name)
    text = text_config(config)
    return TargetInfo(
        name=name,
        architectures=list(getattr(config, "architectures", None) or []),
        num_layers=getattr(text, "num_hidden_layers", None),
        hidden_size=getattr(text, "hidden_size", None),
    )


def check_fits_target(config: DFlashConfig, target: TargetInfo) -> None:
    if target.hidden_size is not None and target.hidden_size != config.hidden_size:
        raise ValueError(
            f"The drafter's hidden size is {config.hidden_size} but the target {target.name!r} has "
            f"{target.hidden_size}: this drafter was built for another target."
        )
    if target.num_layers is not None:
        if config.num_target_layers is not None and config.num_target_layers != target.num_layers:
            raise ValueError(
                f"The drafter was built for a {config.num_target_layers}-layer target, but {target.name!r} has "
                f"{target.num_layers} layers."
            )
        if max(config.target_layer_ids) >= target.num_layers:
            raise ValueError(
                f"target_layer_ids {config.target_layer_ids} do not exist in {target.name!r} "
                f"({target.num_layers} layers)."
            )
