"""The `trainctl` command.

    trainctl serve [--address HOST:PORT] [--health-address HOST:PORT] [--data-dir DIR] [--store URL] [--metrics-port N] [--ray-address ADDR] [--topology FILE] [--warm-pool]
                   [--nodes N] [--gpus-per-node G] [--autoscaling]
    trainctl submit FILE [--watch]       trainctl get JOB [-o yaml|json]     trainctl list [--state S] [--label k=v]
    trainctl cancel JOB                  trainctl logs JOB [-f] [--rank N]   trainctl plan FILE [--cluster PRESET:N | --topology MAP]
    trainctl plan FILE --cluster PRESET:N | --topology MAP --suggest [--top K] [--gpus N] [--headroom F]
    trainctl validate FILE               trainctl demo                       trainctl --version
    trainctl sweep create|get|list|cancel|watch   (hyperparameter sweeps: trainctl.cli.sweep_cmd)
    trainctl data prepare PATHS --out DIR   trainctl export JOB|CKPT --out DIR   trainctl generate JOB|CKPT --prompt T

Client commands find the server in --server or TRAINCTL_SERVER (default 127.0.0.1:50051; several replicas
comma-separated, failed over on UNAVAILABLE) and send TRAINCTL_TOKEN as a bearer token; with no server
answering they end at once, naming the addresses tried. `serve --store` (or TRAINCTL_STORE) names a
PostgreSQL job store. Exit status (trainctl.cli.errors): 0 success, 1 an API or runtime error (or a
watched job that did not succeed), 2 an invalid spec or usage.

It parses in two steps so that `trainctl --help` and a mistyped command load nothing but argparse:
the command is chosen with a parser that lists every command by name (trainctl.cli.parsing), then only
that command's arguments are declared and parsed, and it runs (trainctl.cli.commands, which loads gRPC).
"""

from __future__ import annotations

from trainctl.workers.ray_environment import prepare_ray_environment

prepare_ray_environment()  # before anything imports Ray

import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402

from trainctl.cli.errors import EXIT_ERROR, EXIT_INVALID, EXIT_OK  # noqa: E402
from trainctl.cli.parsing import top_parser  # noqa: E402

__all__ = ["EXIT_ERROR", "EXIT_INVALID", "EXIT_OK", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run `trainctl ARGV`; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = top_parser()[0].parse_known_args(argv)[0].command  # --help, --version and usage errors end here
    from trainctl.cli.commands import run

    return run(command, argv)


if __name__ == "__main__":
    sys.exit(main())
