"""Quickstart: DFlash speculative decoding on a tiny random Llama, offline, in a few seconds.

    python examples/quickstart.py

1. build a small target (any decoder-only transformers causal LM works the same way);
2. build a drafter that fits it with `DFlashDraftModel.from_target` (untrained here: its guesses are random);
3. `import transformers_dflash` makes `target.generate(..., assistant_model=drafter)` decode with DFlash;
4. the output is exactly plain `generate()`'s: DFlash is lossless. A TRAINED drafter makes it faster.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import transformers_dflash  # noqa: F401  (installs the generation hook)
from transformers_dflash import DFlashDraftModel

torch.manual_seed(0)
torch.set_num_threads(1)  # a model this small gains nothing from threads; on a busy machine they cost a lot

# 1. A tiny random target.
config = LlamaConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=None,  # no end-of-sequence token: generate all max_new_tokens
    pad_token_id=0,
    initializer_range=0.1,  # larger random weights than the default 0.02, so the text varies instead of repeating
)
target = LlamaForCausalLM(config).eval()

# 2. An untrained drafter for it: 1 decoder layer, blocks of 8 tokens (1 anchor + 7 drafts).
drafter = DFlashDraftModel.from_target(target, num_layers=1, block_size=8).eval()
print(
    f"target: {sum(p.numel() for p in target.parameters()):,} parameters, {config.num_hidden_layers} layers; "
    f"drafter: {sum(p.numel() for p in drafter.parameters()):,} parameters, reads target layers "
    f"{drafter.config.target_layer_ids}, mask token {drafter.config.mask_token_id}"
)

# 3. Plain greedy decoding, then DFlash decoding of the same prompt.
input_ids = torch.tensor([[1, 17, 42, 99, 7, 64, 23]])
plain = target.generate(input_ids, max_new_tokens=40, do_sample=False)
dflash = target.generate(input_ids, assistant_model=drafter, max_new_tokens=40, do_sample=False)

# 4. Lossless: identical tokens.
assert torch.equal(plain, dflash), f"DFlash changed the output:\n{plain}\n{dflash}"
lengths = drafter.last_acceptance_lengths
steps = lengths[1:]
print("new tokens        :", dflash[0, input_ids.shape[1] :].tolist())
print("identical to plain generate(): yes")
print(f"tokens committed per target forward: {lengths}  (the first is the prefill)")
print(
    f"{len(steps)} verification steps for {sum(lengths)} tokens; mean acceptance length tau = "
    f"{sum(steps) / len(steps):.2f} (1.0 = no draft accepted, as expected from an untrained drafter)"
)
