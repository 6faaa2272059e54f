"""The ``userdp`` command. Each sub-command lives in its own module under ``userdp.cli`` and
exposes ``register(parser)``; this module only wires them together and turns
:class:`userdp.errors.UserError` into one line on stderr and exit status 2."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from userdp import __version__, fileio, plugins
from userdp.errors import UserError, say

#: The commands, in the order `userdp --help` lists them, each with its one-line help: the one place
#: the CLI names its modules. Command NAME lives in ``userdp.cli.NAME``, whose ``register(parser)``
#: adds its options; only the command a command line names is imported (importlib), so
#: ``userdp --help`` and ``userdp account`` do not pay for torch or transformers, and every
#: command module imports what it uses at its top.
COMMANDS = {
    "init": "write a commented starting config for your own data file",
    "train": "fine-tune a causal LM with user-level DP (no arguments: the Shakespeare default)",
    "pretrain": "pretrain a small GPT non-privately on public text (for `userdp train`)",
    "evaluate": "held-out-user loss and perplexity of a run's model (or a model folder)",
    "audit": "train with canary users and measure an empirical lower bound on user-level epsilon",
    "tune": "tune hyperparameters with the tuning itself accounted (private selection)",
    "report": "print the privacy statement of a training run",
    "export": "the release bundle of a run: what may be published, as a Hub model repository",
    "plan": "choose G, cohort size and noise for a compute budget (docs/plan.md)",
    "account": "user-level (epsilon, delta) of ELS / ULS / DP-FedAvg training",
    "calibrate": "noise multiplier for a target user-level (epsilon, delta)",
    "data": "user-partitioned data: statistics, user-grouped store",
    "experiment": "synthetic experiments (docs/experiments.md)",
    "cache": "see or clear what userdp keeps on disk (private data at rest)",
}


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (naming the argument) and exit status 2."""

    def error(self, message: str) -> None:  # noqa: D401 - argparse API
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``userdp`` parser. Every command is listed; the one ``argv`` names (all of them when
    ``argv`` is None) gets its options, which imports its module."""
    named = _command_of(argv) if argv is not None else None
    parser = ArgumentParser(
        prog="userdp",
        description="Fine-tune language models with user-level differential privacy.",
    )
    parser.add_argument("--version", action="version", version=f"userdp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgumentParser)
    for name, help in COMMANDS.items():
        p = sub.add_parser(name, help=help)
        if argv is None or name == named:
            importlib.import_module(f"userdp.cli.{name}").register(p)
    _add_plugin_option(parser)
    return parser


def _command_of(argv: list[str]) -> str | None:
    """The command ``argv`` names: its first word that is not an option (nor ``--plugin``'s value)."""
    skip = False
    for word in argv:
        if skip:
            skip = False
        elif word == "--plugin":
            skip = True
        elif not word.startswith("-"):
            return word
    return None


def _add_plugin_option(parser: argparse.ArgumentParser) -> None:
    """``--plugin`` on every command (main reads it before parsing; argparse only lists it)."""
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE_OR_FILE",
        help="load a plugin first (a module name or a .py file that registers an algorithm, "
        "accountant, per-unit strategy, noise mechanism or sampler; repeatable)",
    )
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                _add_plugin_option(child)


def _offline() -> None:
    """Nothing is downloaded at run time: userdp loads models and tokenizers from local folders
    (``local_files_only``), and this also stops the libraries beneath it from reaching the
    Hugging Face hub on their own (bitsandbytes, for one, fetches a CPU kernel with ``kernels``
    when that package is installed). Set before those libraries are imported; the warning
    bitsandbytes logs when that optional kernel is missing is silenced."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    """Run the ``userdp`` command line; returns the exit status (2: bad input, one line on stderr;
    130: interrupted). argparse's own exits (usage errors, --help, --version) are returned too."""
    _offline()
    argv = list(sys.argv[1:] if argv is None else argv)
    fileio.forget_inputs()
    try:  # before the parser is built: its choices include the names plugins register
        plugins.load_entry_points()
        for spec in plugins.from_argv(argv):
            plugins.load(spec, source="--plugin")
    except UserError as exc:
        print(f"userdp: error: {exc}", file=sys.stderr)
        return 2
    parser = build_parser(argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    args.argv = argv  # the command line as given (`train --nproc` hands it to its workers)
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        say(f"userdp: error: {exc}", 2)  # under `train --nproc`: the launcher prints the job's one line
        return 2
    except OSError as exc:  # the environment (a full disk, no permission), met outside fileio's writers
        if exc.errno not in fileio.ENVIRONMENT_ERRNOS:
            raise
        say(f"userdp: error: {fileio.os_error(exc.filename or '(a file)', exc, 'cannot use it')}", 2)
        return 2
    except KeyboardInterrupt:
        print("userdp: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
