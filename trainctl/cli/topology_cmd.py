"""`trainctl topology ...`: see what discovery sees, and check topology maps, before deploying.

    trainctl topology inspect --topo-m topo.txt [--nvlink nvlink.txt] [--fabric fabric.csv]
                              [--ib-sysfs DIR | --ibstat FILE] [--name NODE] [--labels]
    trainctl topology validate MAP.yaml

`add_arguments(parser)` declares it under the main parser's `topology`; `python -m trainctl.cli.topology_cmd`
runs it alone. The topology model and discovery parsers load when it runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _read(path: Path, what: str) -> str:
    from trainctl.workers.topology.model import TopologyError

    try:
        return path.read_text(encoding="utf-8")
    except OSError as err:
        raise TopologyError(f"{what} {path}: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise TopologyError(f"{what} {path}: not UTF-8 text (byte {err.start})") from None


def inspect(args: argparse.Namespace) -> str:
    """The node entry (or its Ray labels) as YAML, from saved discovery outputs."""
    import yaml

    from trainctl.workers.topology.discovery import (
        parse_fabric_query,
        parse_ib_sysfs_listing,
        parse_ibstat,
        parse_nvlink_status,
        parse_topo_matrix,
        read_ib_sysfs,
    )
    from trainctl.workers.topology.discovery_node import build_node, node_labels

    matrix = parse_topo_matrix(_read(args.topo_m, "--topo-m"), str(args.topo_m))
    nvlink = parse_nvlink_status(_read(args.nvlink, "--nvlink"), str(args.nvlink)) if args.nvlink else None
    fabric = parse_fabric_query(_read(args.fabric, "--fabric"), str(args.fabric)) if args.fabric else None
    ports = None
    if args.ib_sysfs:
        path = Path(args.ib_sysfs)
        ports = read_ib_sysfs(path) if path.is_dir() else parse_ib_sysfs_listing(_read(path, "--ib-sysfs"), str(path))
    elif args.ibstat:
        ports = parse_ibstat(_read(args.ibstat, "--ibstat"), str(args.ibstat))
    node = build_node(args.name, matrix, nvlink, ports, fabric)
    data = node_labels(node) if args.labels else node.model_dump(mode="json", exclude_defaults=True)
    return yaml.safe_dump(data, sort_keys=False)


def validate(args: argparse.Namespace) -> str:
    from trainctl.workers.placement import capacity  # the solver's imports: only this command needs them
    from trainctl.workers.topology.model import load_topology

    topology = load_topology(args.map)
    domains = len(topology.spec.nvlink_domains)
    return (
        f"{args.map}: valid TopologyMap {topology.metadata.name!r}: {len(topology.nodes)} nodes, "
        f"{capacity(topology)} usable GPUs, {domains} NVLink domains, {len(topology.spec.switches)} switches\n"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare `inspect` and `validate` under the `topology` command's parser."""
    sub = parser.add_subparsers(dest="topology_command", required=True)
    ins = sub.add_parser("inspect", help="print the node entry discovery builds from saved command outputs")
    ins.add_argument("--topo-m", type=Path, required=True, help="saved `nvidia-smi topo -m` output")
    ins.add_argument("--nvlink", type=Path, help="saved `nvidia-smi nvlink -s` output")
    ins.add_argument("--fabric", type=Path, help="saved `nvidia-smi --query-gpu=index,fabric.clusterUuid,fabric.cliqueId --format=csv`")
    ib = ins.add_mutually_exclusive_group()
    ib.add_argument("--ib-sysfs", help="a copy of /sys/class/infiniband, or `grep . */ports/*/*` output saved there")
    ib.add_argument("--ibstat", type=Path, help="saved `ibstat` output")
    ins.add_argument("--name", default="node-0", help="node name for the entry (default node-0)")
    ins.add_argument("--labels", action="store_true", help="print the Ray node labels instead of the entry")
    ins.set_defaults(handler=inspect)
    val = sub.add_parser("validate", help="load and validate a TopologyMap YAML file")
    val.add_argument("map", type=Path, help="the map")
    val.set_defaults(handler=validate)


def run(args: argparse.Namespace) -> int:
    """Execute a parsed `topology` command: output on stdout, a clear error on stderr with exit code 2."""
    from trainctl.workers.topology.model import TopologyError

    try:
        sys.stdout.write(args.handler(args))
    except TopologyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trainctl")
    add_arguments(parser.add_subparsers(dest="command", required=True).add_parser("topology"))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
