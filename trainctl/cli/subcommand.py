"""What the command modules that run both under `trainctl` and alone (`python -m trainctl.cli.NAME_cmd`) share.

Each such module declares `add_arguments(parser)` and `run(args) -> exit code`; trainctl.cli.commands
declares them under the main parser's command, and `run_alone` parses and runs one as a program of its own.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

AddArguments = Callable[[argparse.ArgumentParser], None]
RunCommand = Callable[[argparse.Namespace], int]


def run_alone(
    name: str, doc: str, add_arguments: AddArguments, run: RunCommand, argv: Sequence[str] | None,
    *, job_ids: bool = False,
) -> int:
    """Parse `argv` as `trainctl NAME` on its own (described by the first line of `doc`) and run it.

    `job_ids`: the command accepts a job id, so it takes `--server` (which the main parser adds to every command).
    """
    parser = argparse.ArgumentParser(prog=f"trainctl {name}", description=doc.splitlines()[0])
    if job_ids:
        parser.add_argument("--server", help="service address(es) for job ids, comma-separated")
    add_arguments(parser)
    return run(parser.parse_args(argv))
