"""Uploading a drafter to the Hugging Face Hub in any layout, with its model card."""

from __future__ import annotations

import tempfile

from ..model_card import CardMetadata
from ..modeling_dflash import DFlashDraftModel
from .export import export_drafter


def push_drafter_to_hub(
    drafter: DFlashDraftModel,
    repo_id: str,
    layout: str = "hub",
    target_name_or_path=None,
    card_metadata: CardMetadata | dict | None = None,
    private: bool | None = None,
    token: str | bool | None = None,
    commit_message: str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
):
    """Upload `drafter` to the Hub repo `repo_id` in `layout`, WITH its model card (returns the commit info).

    `drafter.push_to_hub(repo_id)` works as for any transformers model (config with `auto_map`, the three code files,
    model.safetensors), but on a new repo transformers writes its own generic README; it keeps an existing one. This
    uploads the full export, our card included; later `drafter.push_to_hub(repo_id)` calls then keep that card.
    """
    from huggingface_hub import HfApi

    api = HfApi()
    repo_id = api.create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
    metadata = CardMetadata(model_id=repo_id).merged(card_metadata)
    with tempfile.TemporaryDirectory() as tmp:
        export_drafter(drafter, tmp, layout, target_name_or_path=target_name_or_path, card_metadata=metadata)
        return api.upload_folder(
            repo_id=repo_id,
            folder_path=tmp,
            commit_message=commit_message or f"Upload DFlash drafter ({layout} layout)",
            token=token,
            revision=revision,
            create_pr=create_pr,
        )
