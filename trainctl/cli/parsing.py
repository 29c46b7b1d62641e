"""The `trainctl` command's first parser: every command by name and help, `--version` and `--server`.

It loads nothing but argparse, so `trainctl --help`, `--version` and a mistyped command end before gRPC
or any command's module loads; trainctl.cli.commands declares the chosen command's arguments on it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from trainctl.cli.addresses import DEFAULT_SERVER, SERVER_ENV

COMMANDS = {
    "serve": "run the service",
    "submit": "submit a job spec",
    "get": "show one job",
    "list": "list jobs",
    "cancel": "cancel a job that has not ended",
    "logs": "a job's events (state changes, steps, log lines)",
    "plan": "dry run: validation, placement, memory, step time (on the server's pool, or offline)",
    "validate": "check a job spec locally",
    "demo": "embedded 2-node Ray + service + a hybrid-parallel job, end to end",
    "report": "PNG + HTML report of a job's recorded steps and placement, or of a sweep's trials",
    "token": "make or hash an API token",
    "topology": "inspect discovery outputs and validate topology maps",
    "data": "prepare training data (pre-tokenized token shards)",
    "export": "write a job's trained model as Hugging Face safetensors (its family; Mixtral for MoE, Llama for presets)",
    "generate": "sample text from a job's checkpoint",
    "sweep": "hyperparameter sweeps: create, get, list, cancel, watch, report",
}
"""Every command and its one-line help, in the order `trainctl --help` lists them."""


def package_version() -> str:
    """The installed distribution's version, else `trainctl.__version__`, else "unknown"."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trainctl")
    except PackageNotFoundError:
        import trainctl

        return str(getattr(trainctl, "__version__", "unknown"))


class _VersionAction(argparse.Action):
    """`--version`: print `trainctl VERSION` on stdout and exit 0 (the version looked up only then)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None) -> None:
        print(f"trainctl {package_version()}")
        parser.exit()


def top_parser(chosen: str | None = None) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The main parser and its command parsers. Only `chosen`'s parser has a -h of its own (its
    arguments are the caller's to declare); the others accept anything, which the second step parses."""
    parser = argparse.ArgumentParser(prog="trainctl", description="Distributed LLM training service.", allow_abbrev=False)
    parser.add_argument("--version", action=_VersionAction)
    parser.add_argument("--server", help=f"service address HOST:PORT, or several replicas' comma-separated, tried in turn "
                        f"while one answers UNAVAILABLE (default: ${SERVER_ENV} or {DEFAULT_SERVER})")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = {name: sub.add_parser(name, help=text, description=text, add_help=name == chosen)
                for name, text in COMMANDS.items()}
    return parser, commands
