"""Every `trainctl` command's arguments and handler, and running one (the second step of trainctl.cli.main).

A client command gets a client that asks for the server before its first call (`fail_fast`): with none
answering it ends at once with one line naming the addresses tried and how to start or name a server.
Failures end as one `error: ...` line (and a `  field: problem` line per offending field) with the
exit status of trainctl.cli.errors.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from trainctl.cli import (
    data_cmd,
    demo,
    export_cmd,
    generate_cmd,
    job_cmd,
    plan_cmd,
    serve_cmd,
    sweep_cmd,
    token_cmd,
    topology_cmd,
)
from trainctl.cli.addresses import SERVER_ENV, AddressError
from trainctl.cli.client import ServerUnreachable, TrainctlClient
from trainctl.cli.errors import EXIT_ERROR, EXIT_INVALID, EXIT_OK, CliError
from trainctl.cli.parsing import top_parser
from trainctl.spec.violations import SpecError

START_HINT = f"start one with `trainctl serve`, or give its address with --server HOST:PORT or ${SERVER_ENV}"


@dataclass(frozen=True)
class Command:
    """How one command is declared and run: `run(args)`, or `run(args, client)` when it needs the server."""

    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[..., int]
    needs_client: bool = False


def _submit_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file")
    parser.add_argument("--watch", "-w", action="store_true", help="show live progress until the job ends")


def _get_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job")
    parser.add_argument("-o", "--output", choices=["table", "yaml", "json"], default="table")


def _list_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state", action="append", help="only jobs in this state (repeatable)")
    parser.add_argument("--label", action="append", help="only jobs with label key=value (repeatable)")


def _job_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job")


def _logs_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job")
    parser.add_argument("-f", "--follow", action="store_true", help="keep following until the job ends")
    parser.add_argument("--rank", type=int, help="only this rank's log lines (a command job's program output)")


def _plan_arguments(parser: argparse.ArgumentParser) -> None:
    from trainctl.workers.topology.presets import CLUSTER_PRESETS

    parser.add_argument("file")
    offline = parser.add_mutually_exclusive_group()
    offline.add_argument("--cluster", metavar="PRESET:N",
                         help="plan offline, no server, on N nodes or racks of a named cluster ("
                              + ", ".join(f"{p.name}: {p.gpus_per_unit} GPUs per {p.unit}" for p in CLUSTER_PRESETS) + ")")
    offline.add_argument("--topology", type=Path, metavar="MAP", help="plan offline, no server, on a topology map file")
    parser.add_argument("--suggest", action="store_true",
                        help="with --cluster or --topology: search the layouts of the job's model, sequence length and global "
                             "batch on all the cluster's GPUs (or --gpus N of them) and print the fastest by modelled step time")
    parser.add_argument("--top", type=serve_cmd.positive_int, default=5, metavar="K",
                        help="with --suggest: how many layouts to print (default 5)")
    parser.add_argument("--gpus", type=serve_cmd.positive_int, metavar="N",
                        help="with --suggest: search layouts on N of the cluster's GPUs (default: all; the spec's "
                             "resources.gpus is what the search chooses)")
    parser.add_argument("--headroom", type=float, metavar="F",
                        help="with --suggest: share of each GPU's memory a layout must leave free, from 0 to below 1 "
                             "(default 0.1)")


def _validate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file")
    parser.add_argument("--pool-gpus", type=int, help="also check the job fits a pool of this many GPUs")


def _report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", help="a job id, or a sweep id (objective per trial, parameters, curves)")
    parser.add_argument("--out", type=Path, help="PNG path (default: <id>-report.png)")
    parser.add_argument("--no-html", action="store_true", help="write only the PNG")


HANDLERS = {
    "serve": Command(serve_cmd.add_arguments, serve_cmd.run),
    "submit": Command(_submit_arguments, job_cmd.submit, needs_client=True),
    "get": Command(_get_arguments, job_cmd.get, needs_client=True),
    "list": Command(_list_arguments, job_cmd.list_jobs, needs_client=True),
    "cancel": Command(_job_argument, job_cmd.cancel, needs_client=True),
    "logs": Command(_logs_arguments, job_cmd.logs, needs_client=True),
    "plan": Command(_plan_arguments, plan_cmd.plan),
    "validate": Command(_validate_arguments, plan_cmd.validate),
    "demo": Command(demo.add_arguments, demo.run),
    "report": Command(_report_arguments, job_cmd.report, needs_client=True),
    "token": Command(token_cmd.add_arguments, token_cmd.run),
    "topology": Command(topology_cmd.add_arguments, topology_cmd.run),
    "data": Command(data_cmd.add_arguments, data_cmd.run),
    "export": Command(export_cmd.add_arguments, export_cmd.run),
    "generate": Command(generate_cmd.add_arguments, generate_cmd.run),
    "sweep": Command(sweep_cmd.add_arguments, sweep_cmd.run, needs_client=True),
}
"""What runs each command of trainctl.cli.parsing.COMMANDS (the same names)."""


def command_parser(command: str) -> argparse.ArgumentParser:
    """The main parser with `command`'s arguments declared (the other commands listed by name only)."""
    parser, commands = top_parser(command)
    HANDLERS[command].arguments(commands[command])
    return parser


def run(command: str, argv: Sequence[str]) -> int:
    """Parse `argv` as `trainctl COMMAND ...` and run it; returns the exit status."""
    args = command_parser(command).parse_args(argv)
    handler = HANDLERS[command]
    try:
        if handler.needs_client:
            with TrainctlClient(args.server, fail_fast=True) as client:
                return handler.run(args, client)
        return handler.run(args)
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        for violation in exc.violations:
            print(f"  {violation}", file=sys.stderr)
        return exc.status
    except SpecError as exc:  # a spec refused past load_job (one with no proto form, say)
        print("error: not a valid spec", file=sys.stderr)
        for violation in exc.violations:
            print(f"  {violation}", file=sys.stderr)
        return EXIT_INVALID
    except AddressError as exc:  # --server or $TRAINCTL_SERVER names no address
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except ServerUnreachable as exc:
        print(f"error: {exc}; {START_HINT}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:  # the reader went away (`trainctl logs JOB | head`): stop quietly
        with contextlib.suppress(OSError, ValueError):  # so the flush at exit has nowhere to fail
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except grpc.RpcError as exc:
        return _rpc_failure(exc)
    except KeyboardInterrupt:
        return 130


def _rpc_failure(exc: Any) -> int:
    """Print a call's failure (its field violations, if any) and return the exit status for it."""
    from trainctl.wire.errors import field_violations

    violations = field_violations(exc)
    if violations:
        print(f"error: {exc.code().name}: the server refused the request", file=sys.stderr)
    else:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
    for violation in violations:
        print(f"  {violation}", file=sys.stderr)
    return EXIT_INVALID if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else EXIT_ERROR

