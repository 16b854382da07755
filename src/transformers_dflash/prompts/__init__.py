"""Data files for `transformers_dflash.data` (this package holds no code).

Each `<category>.json` (except `eval_fingerprints.json`) describes one family of composed training prompts:

    {"name": ..., "weight": relative share of the composed prompts, "description": ...,
     "templates": ["Write a {language} function that {task}.", ...],
     "slots": {"language": [...], "task": [...], ...}}

Placeholders: `{slot}` draws a value from `slots[slot]` (the same `{slot}` repeated in one template repeats the value),
`{slot#1}` is a second, different draw of the same slot, `{int:A:B}` draws a fresh integer in [A, B] at each occurrence
and `{int:A:B#k}` one integer shared by every `#k` occurrence. `compose_prompts()` turns these into deterministic,
deduplicated prompts.

`eval_fingerprints.json` holds hashes (no text) of the MT-Bench turns and HumanEval prompts; training prompts that
match them are dropped, so the training set stays disjoint from the evaluation sets even where those packages are not
installed. Rebuild it with `transformers_dflash.data.compute_eval_fingerprints()`.
"""
