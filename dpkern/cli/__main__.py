"""``dpkern <command>``: each command is a module of dpkern.cli exposing
``add_arguments(parser)`` and ``run(args) -> int``.

Bad input exits with code 2 and a one-line error naming the option (argparse style)."""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "finetune": "private fine-tuning of a causal language model (the main job)",
    "compare": "compare the DP optimizers on real data at several epsilons",
    "audit": "one-run privacy audit of a finetune configuration (canaries, epsilon lower bound)",
}


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad option value is ONE line (``prog: error: ...``), exit code 2:
    the usage block is for ``--help``."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(
        prog="dpkern", description="Differentially private training with fused kernels."
    )
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"dpkern {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="command")
    modules = {}
    for name, help_text in COMMANDS.items():
        try:
            modules[name] = importlib.import_module(f"dpkern.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"dpkern.cli.{name}":
                raise
            continue
        p = sub.add_parser(
            name,
            help=help_text,
            description=modules[name].__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        modules[name].add_arguments(p)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
