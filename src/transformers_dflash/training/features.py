"""Context features: the target's hidden states the drafter reads, and `dflash features`, which caches them in
the shards (offline training) together with the target's own greedy choice at every position (`target_ids`).

`target_ids[t]` is the token the target ranks first after `input_ids[:t]`: what greedy verification accepts there.
Training can label with it instead of the text (`loss.py`, `labels="target"`), so that an engine that answers a
little differently from the target (int8, another kernel, off-the-shelf text) never teaches the drafter a token the
verifier would reject."""

import io
import json
import shutil
import time
from pathlib import Path

import torch
from torch import nn

from ..configuration_dflash import text_config
from ..data import disk_full_error, list_shards, load_shard, read_manifest, write_atomically
from ..target_model import feature_modules, keep_outputs, remove_hooks
from .batches import collate, iter_training_examples

FEATURES_INFO = "features.json"
# The target's top tokens kept per position by default: the soft labels of distillation, which `dflash train` uses
# where they are at hand (loop.DEFAULT_KL_WEIGHT; docs/training.md, "KL distillation on 1,148 new answers"). 16 cost
# 1.7 % more disk than the features alone.
DEFAULT_TOP_K = 16


def read_features_info(data_dir: str | Path) -> dict | None:
    """The `features.json` that `dflash features` writes beside its shards; None where there is none."""
    info_path = Path(data_dir) / FEATURES_INFO
    if not info_path.exists():
        return None
    try:
        info = json.loads(info_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(
            f"{info_path} is not valid JSON ({error}); an interrupted copy? Copy the folder again, or recompute its "
            "features with `dflash features --out NEW_DIR`."
        ) from None
    if not isinstance(info, dict):
        raise ValueError(f"{info_path} holds {type(info).__name__}, not the object `dflash features` writes.")
    return info


@torch.no_grad()
def cache_context_features(
    target: nn.Module,
    data_dir: str | Path,
    out_dir: str | Path,
    target_layer_ids: list[int],
    batch_size: int = 8,
    max_length: int = 2048,
    dtype: torch.dtype = torch.bfloat16,
    progress: bool = True,
    top_k: int | None = None,
    follow: bool = False,
    poll_seconds: float = 60.0,
) -> Path:
    """Offline training data: every shard of `data_dir` again, each example with its `context_features`.

    The target reads each (truncated) sequence once; the features are stored in `dtype` (bfloat16 halves the disk
    and is what a bf16 target would produce anyway). An example whose prompt fills `max_length` keeps no response
    token and is left out. Resumable: shards already in `out_dir` are kept. `features.json`
    records the layer ids, so that training refuses features of other layers.

    top_k > 0 also keeps, at every position, the target's `top_k` most likely next tokens and their log-probabilities
    (`target_top_ids`, `target_top_logprobs`): the soft labels of `dflash train --kl-weight`; 0 keeps none. None
    (default): the `top_k` of the features already in `out_dir` when resuming, else `DEFAULT_TOP_K`.

    follow=True keeps going while `dflash regenerate` writes `data_dir`: it looks for new shards every `poll_seconds`
    and returns once the regeneration's manifest says it is complete and every shard has its features.
    """
    from tqdm.auto import tqdm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    info_path = out_dir / FEATURES_INFO
    previous = read_features_info(out_dir)
    resuming = previous is not None and any(out_dir.glob("shard-*.pt"))  # shards that new ones must match
    if top_k is None:
        top_k = previous.get("target_top_k", 0) if resuming else DEFAULT_TOP_K
    top_k = min(top_k, text_config(target.config).vocab_size)
    info = {
        "target_layer_ids": [int(i) for i in target_layer_ids],
        "max_length": int(max_length),
        "dtype": str(dtype).replace("torch.", ""),
        "source": str(Path(data_dir).resolve()),
        "target_choices": True,  # every shard also stores `target_ids`
        "target_top_k": int(top_k),
        "shard_sizes": {},  # examples per finished shard, so that training need not load them to count
    }
    if previous is not None:
        if resuming and not previous.get("target_choices"):
            raise ValueError(
                f"{out_dir} holds features of an older `dflash features` without the target's choices; resuming "
                "there would mix shards with and without them. Use another --out directory, or delete this one."
            )
        if resuming and previous.get("target_top_k", 0) != top_k:
            raise ValueError(
                f"{out_dir} holds features with the target's top {previous.get('target_top_k', 0)} tokens per "
                f"position; asked for --top-k {top_k}. Resume with --top-k {previous.get('target_top_k', 0)}, or use "
                "another --out directory."
            )
        if previous.get("target_layer_ids") != info["target_layer_ids"] or previous.get("max_length") != max_length:
            raise ValueError(
                f"{out_dir} holds features of layers {previous.get('target_layer_ids')} (max_length "
                f"{previous.get('max_length')}); asked for {info['target_layer_ids']} ({max_length}). Use another "
                "--out directory, or delete this one."
            )
        info["shard_sizes"] = previous.get("shard_sizes", {})
    info_path.write_text(json.dumps(info, indent=1))
    device = next(target.parameters()).device
    # bytes per stored position: the features, then input_ids, loss_mask and target_ids, then the top tokens
    position_bytes = len(target_layer_ids) * text_config(target.config).hidden_size * dtype.itemsize + 17
    position_bytes += top_k * 6
    manifest = read_manifest(data_dir) if follow else None
    if follow and manifest is None:
        raise ValueError(
            f"--follow waits for the shards that `dflash regenerate` is still writing, but {data_dir} has no "
            "manifest.json of a regeneration. Leave --follow out for a finished folder."
        )
    shards = list_shards(data_dir)
    total = manifest["num_shards"] if follow else len(shards)
    bar = tqdm(total=total, desc="features", unit="shard", disable=not progress)
    bar.update(sum((out_dir / f"{shard.stem}.pt").exists() for shard in shards))
    agreed = labelled = 0  # response tokens (of the shards computed in this run) that equal the target's choice
    skipped = 0  # examples of those shards left out: truncated to max_length, they keep no response token
    while True:
        # Read "complete" before listing: a regeneration marks itself complete only after its last shard is on disk.
        complete = not follow or read_manifest(data_dir).get("complete", False)
        pending = [shard for shard in list_shards(data_dir) if not (out_dir / f"{shard.stem}.pt").exists()]
        if not pending:
            if complete:
                break
            time.sleep(poll_seconds)
            continue
        shard = pending[0]
        destination = out_dir / f"{shard.stem}.pt"  # features are tensors: always the torch format
        examples = load_shard(shard)
        finished = len(list(out_dir.glob("shard-*.pt")))
        needed = position_bytes * sum(min(len(e["input_ids"]), max_length) for e in examples)
        free = shutil.disk_usage(out_dir).free
        if free < needed:  # refuse before the target's pass over the shard, not after it
            message = (
                f"{destination.name} needs about {needed / 1e9:.2f} GB and {out_dir} has {free / 1e9:.2f} GB free."
            )
            raise disk_full_error(message, finished)
        order = sorted(range(len(examples)), key=lambda i: -len(examples[i]["input_ids"]))
        records: list[dict | None] = [None] * len(examples)
        for start in range(0, len(order), batch_size):
            chunk = [examples[i] for i in order[start : start + batch_size]]
            batch = collate(chunk, max_length)
            features, choices, top = target_features_and_choices(
                target,
                batch["input_ids"].to(device),
                target_layer_ids,
                None if batch["attention_mask"] is None else batch["attention_mask"].to(device),
                top_k=top_k,
            )
            for row, i in enumerate(order[start : start + batch_size]):
                length = min(len(examples[i]["input_ids"]), max_length)
                if not examples[i]["loss_mask"][:length].any():
                    skipped += 1  # a prompt longer than max_length: no response token left to learn from
                    continue
                records[i] = {
                    "input_ids": examples[i]["input_ids"][:length].clone(),
                    "loss_mask": examples[i]["loss_mask"][:length].clone(),
                    "context_features": features[row, :length].to("cpu", dtype).clone(),
                    "target_ids": choices[row, :length].cpu().clone(),
                }
                if top is not None:  # ids fit int32; log-probabilities need no more than float16
                    records[i]["target_top_ids"] = top[0][row, :length].to("cpu", torch.int32).clone()
                    records[i]["target_top_logprobs"] = top[1][row, :length].to("cpu", torch.float16).clone()
                response = records[i]["loss_mask"]
                agreed += int((records[i]["target_ids"] == records[i]["input_ids"])[response].sum())
                labelled += int(response.sum())
        records = [record for record in records if record is not None]
        buffer = io.BytesIO()
        torch.save(records, buffer)
        write_atomically(destination, buffer.getvalue(), "features shard", finished)  # whole or absent
        info["shard_sizes"][destination.name] = {"examples": len(records), "bytes": destination.stat().st_size}
        info_path.write_text(json.dumps(info, indent=1))
        bar.update(1)
        bar.set_postfix(target_agreement=f"{agreed / max(labelled, 1):.4f}")
    bar.close()
    if labelled:
        info["target_agreement"] = agreed / labelled  # of the shards computed by the last run
        info["skipped_no_response"] = skipped
        info_path.write_text(json.dumps(info, indent=1))
    return out_dir


def has_top_tokens(data_dir: str | Path) -> bool:
    """Whether training on `data_dir` has the target's top tokens at hand for distillation: features cached with
    them, or plain shards (the target runs during training and computes them itself). A folder without
    `features.json` (shards written by hand in the documented format) is judged by its first example."""
    info = read_features_info(data_dir)
    if info is not None:
        return bool(info.get("target_top_k"))
    first = next(iter_training_examples(data_dir), {})
    return "context_features" not in first or "target_top_ids" in first


def check_cached_features(
    data_dir: str | Path, target_layer_ids: list[int], labels: str = "auto", kl_weight: float = 0.0
) -> None:
    """Refuse offline features of other target layers than the drafter's (they would train it on the wrong input),
    `labels="target"` on features cached without the target's choices, and `kl_weight > 0` on features without the
    target's top tokens."""
    info = read_features_info(data_dir)
    if info is None:
        return
    if kl_weight > 0 and not info.get("target_top_k"):
        raise ValueError(
            f"{data_dir} holds features without the target's top tokens per position, which --kl-weight needs. "
            "Cache them with `dflash features --top-k 16 --out NEW_DIR`, or train with --kl-weight 0."
        )
    if labels == "target" and not info.get("target_choices"):
        raise ValueError(
            f"{data_dir} holds features cached without the target's choices (an older `dflash features`), which "
            "--labels target needs. Recompute them with `dflash features --out NEW_DIR`, or train with --labels text."
        )
    cached = info.get("target_layer_ids")
    if cached != [int(i) for i in target_layer_ids]:
        raise ValueError(
            f"{data_dir} holds target features of layers {cached}, but the drafter reads layers "
            f"{list(target_layer_ids)}. Train with --target-layer-ids {' '.join(map(str, cached))}, or cache "
            "features for these layers with `dflash features`."
        )


def check_replay_features(data_dir: str | Path, target_layer_ids: list[int]) -> None:
    """Refuse, as held-out data for `replay_acceptance`, a folder that is not `dflash features` output with the
    target's choices for the drafter's layers."""
    info = read_features_info(data_dir)
    fix = (
        "Cache the target's greedy answers to held-out prompts and their features: `dflash regenerate --prompts "
        f"mtbench --out ANSWERS`, then `dflash features --data ANSWERS --out {data_dir}`"
    )
    if info is None:
        raise ValueError(f"--val-features {data_dir}: no {FEATURES_INFO} there, so no cached features. {fix}.")
    if not info.get("target_choices"):
        raise ValueError(f"--val-features {data_dir}: features cached without the target's choices. {fix}.")
    if info.get("target_layer_ids") != [int(i) for i in target_layer_ids]:
        raise ValueError(
            f"--val-features {data_dir}: features of target layers {info.get('target_layer_ids')}, but the drafter "
            f"reads layers {list(target_layer_ids)}. {fix} --target-layer-ids {' '.join(map(str, target_layer_ids))}."
        )


@torch.no_grad()
def target_context_features(target: nn.Module, input_ids, layer_ids, attention_mask=None) -> torch.Tensor:
    """The drafter's context: the target's hidden_states[i + 1] for i in `layer_ids`, concatenated `[b, S, K * H]`."""
    return target_features_and_choices(target, input_ids, layer_ids, attention_mask, choices=False)[0]


@torch.no_grad()
def target_features_and_choices(
    target: nn.Module,
    input_ids,
    layer_ids,
    attention_mask=None,
    choices: bool = True,
    chunk: int = 256,
    top_k: int = 0,
) -> tuple[torch.Tensor, torch.LongTensor | None, tuple[torch.LongTensor, torch.Tensor] | None]:
    """`target_context_features` and, from the same forward, the target's greedy choice at every position
    (`target_ids [b, S]`: `target_ids[:, t]` = argmax of the logits after `input_ids[:, :t]`; position 0, which
    nothing predicts, keeps its own token), and with `top_k > 0` the target's `top_k` most likely tokens there with
    their log-probabilities (`(top_ids, top_logprobs)`, each `[b, S, top_k]`, ranked; zeros at position 0), else None.

    The LM head runs `chunk` positions at a time, so the `[b, S, vocab]` logits never exist at once. Softcapping and
    logit scales that some targets apply after the head are monotonic, so the argmax of the head is theirs.
    """
    # The decoding loop's hooks, not output_hidden_states: the same tensors (so training sees what decoding will),
    # and only the chosen layers' outputs are kept, not all of them.
    captured = [None] * len(layer_ids)
    handles = keep_outputs(feature_modules(target, layer_ids), captured)
    try:
        outputs = target.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        remove_hooks(handles)
    features = torch.cat(captured, dim=-1)
    if not choices and not top_k:
        return features, None, None
    head = target.get_output_embeddings()
    last = outputs.last_hidden_state
    batch, seq_len = input_ids.shape
    target_ids = input_ids.clone()
    top = None
    top_k = min(top_k, text_config(target.config).vocab_size)
    if top_k:
        top = (
            input_ids.new_zeros(batch, seq_len, top_k),
            last.new_zeros(batch, seq_len, top_k, dtype=torch.float32),
        )
    for start in range(0, seq_len - 1, chunk):
        end = min(start + chunk, seq_len - 1)
        logits = head(last[:, start:end])
        target_ids[:, start + 1 : end + 1] = logits.argmax(-1)
        if top_k:
            values, ids = final_logits(target, logits).float().log_softmax(-1).topk(top_k, dim=-1)
            top[0][:, start + 1 : end + 1] = ids
            top[1][:, start + 1 : end + 1] = values
    return features, target_ids if choices else None, top


def final_logits(target: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """The target's logits from its LM head's output: the scale (Cohere, Granite) and softcap (Gemma 2) that some
    families apply after the head. Monotonic, so the argmax is the head's; the distribution is not."""
    config = text_config(target.config)
    if getattr(config, "logit_scale", None):
        logits = logits * config.logit_scale
    if getattr(config, "logits_scaling", None):
        logits = logits / config.logits_scaling
    softcap = getattr(config, "final_logit_softcapping", None)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def shard_sizes(data_dir: str | Path, shards: list[Path]) -> list[int]:
    """Examples per shard: from features.json where `dflash features` recorded them for a file of the same size,
    else by loading the shard."""
    recorded = (read_features_info(data_dir) or {}).get("shard_sizes", {})
    sizes = []
    for path in shards:
        known = recorded.get(path.name)
        if known is not None and known["bytes"] == path.stat().st_size:
            sizes.append(known["examples"])
        else:
            sizes.append(len(load_shard(path)))
    return sizes
