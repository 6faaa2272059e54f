"""The ``userdp`` command. Each sub-command lives in its own module under ``userdp.cli`` and
exposes ``register(subparsers)``; this module only wires them together and turns
:class:`userdp.errors.UserError` into one line on stderr and exit status 2."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from userdp import __version__, fileio, launcher, plugins
from userdp.errors import UserError

# Module names under userdp.cli, in the order they appear in `userdp --help`.
COMMAND_MODULES = [
    "init",
    "train",
    "pretrain",
    "evaluate",
    "audit",
    "tune",
    "report",
    "plan",
    "account",
    "calibrate",
    "data",
    "experiment",
    "cache",
]


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (naming the argument) and exit status 2."""

    def error(self, message: str) -> None:  # noqa: D401 - argparse API
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="userdp",
        description="Fine-tune language models with user-level differential privacy.",
    )
    parser.add_argument("--version", action="version", version=f"userdp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgumentParser)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"userdp.cli.{name}")
        except ModuleNotFoundError as exc:  # a command not built yet
            if exc.name == f"userdp.cli.{name}":
                continue
            raise
        module.register(sub)
    _add_plugin_option(parser)
    return parser


def _add_plugin_option(parser: argparse.ArgumentParser) -> None:
    """``--plugin`` on every command (main reads it before parsing; argparse only lists it)."""
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE_OR_FILE",
                        help="load a plugin first (a module name or a .py file that registers an algorithm, "
                             "accountant, per-unit strategy, noise mechanism or sampler; repeatable)")
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
    parser = build_parser()
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
        launcher.say(f"userdp: error: {exc}", 2)  # under `train --nproc`: the launcher prints the job's one line
        return 2
    except OSError as exc:  # the environment (a full disk, no permission), met outside fileio's writers
        if exc.errno not in fileio.ENVIRONMENT_ERRNOS:
            raise
        launcher.say(f"userdp: error: {fileio.os_error(exc.filename or '(a file)', exc, 'cannot use it')}", 2)
        return 2
    except KeyboardInterrupt:
        print("userdp: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
