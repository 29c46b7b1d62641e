"""Parsers for what discovery reads on a node: `nvidia-smi topo -m`, `nvidia-smi nvlink -s`, the NVLink
fabric clique query, sysfs InfiniBand ports (and `ibstat`). Pure text in, dataclasses out; a malformed
input raises `DiscoveryError` naming the source, line and what was expected.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from trainctl.workers.topology.model import TopologyError

CONNECTIONS = ("X", "SYS", "SOC", "NODE", "PHB", "PXB", "PIX", "PXN")
"""Non-NVLink cells of `nvidia-smi topo -m` (SOC is SYS in old drivers; PXN is through a peer GPU)."""
PCIE_CELLS = ("PIX", "PXB", "PHB", "NODE", "SYS", "SOC")
"""Cells that are a PCIe path class between two GPUs."""
NEAR = ("PIX", "PXB")
"""Cells that make a NIC "nearest" to a GPU: at most PCIe bridges, no host bridge."""
_MULTIWORD = {"CPU Affinity": "CPU_Affinity", "NUMA Affinity": "NUMA_Affinity", "GPU NUMA ID": "GPU_NUMA_ID"}
_NVLINK_CELL = re.compile(r"^NV(\d+)$")
_GPU = re.compile(r"^GPU(\d+)$")


class DiscoveryError(TopologyError):
    """Discovery input that cannot be parsed; the message names the source and line."""


@dataclass
class TopoMatrix:
    """`nvidia-smi topo -m`, parsed."""

    gpus: list[int]
    """GPU indices, in column order."""
    nics: list[str]
    """NIC device names (NIC Legend applied; old drivers name the columns mlx5_N directly)."""
    cells: dict[tuple[str, str], str]
    """(row device, column device) -> connection (X, NV12, PIX, ...); devices as 'GPU0' or NIC device name."""
    cpu_affinity: dict[int, str] = field(default_factory=dict)
    numa_affinity: dict[int, list[int]] = field(default_factory=dict)
    """GPU -> NUMA nodes of its CPU affinity (a node list on Grace systems); empty when N/A."""
    gpu_numa_id: dict[int, int] = field(default_factory=dict)
    """GPU -> NUMA node of the GPU's own memory (Grace systems), when reported."""

    def nvlink_pairs(self) -> list[tuple[int, int, int]]:
        """(a, b, bonded links) for every GPU pair a < b connected by NVLink."""
        out = []
        for i, a in enumerate(self.gpus):
            for b in self.gpus[i + 1 :]:
                match = _NVLINK_CELL.match(self.cells[(f"GPU{a}", f"GPU{b}")])
                if match:
                    out.append((a, b, int(match.group(1))))
        return out

    def pcie_paths(self) -> list[tuple[int, int, str]]:
        """(a, b, path class) for every GPU pair a < b without NVLink (SOC, old drivers' SYS, as SYS)."""
        out = []
        for i, a in enumerate(self.gpus):
            for b in self.gpus[i + 1 :]:
                cell = self.cells[(f"GPU{a}", f"GPU{b}")]
                if _NVLINK_CELL.match(cell):
                    continue
                if cell not in PCIE_CELLS:
                    raise DiscoveryError(f"GPU{a}-GPU{b} is {cell}, which is not a path between two GPUs")
                out.append((a, b, "SYS" if cell == "SOC" else cell))
        return out

    def numa_of(self, gpu: int) -> int | None:
        """The NUMA node a GPU is attached to (first of its affinity list), None when not reported."""
        nodes = self.numa_affinity.get(gpu, [])
        return nodes[0] if nodes else None

    def nearest_gpus(self, nic: str) -> list[int]:
        """GPUs a NIC reaches through PCIe bridges only (PIX / PXB)."""
        return [g for g in self.gpus if self.cells[(nic, f"GPU{g}")] in NEAR]

    def nic_paths(self) -> list[tuple[int, str, str]]:
        """(gpu, NIC, path class) for every GPU: the NIC at its best PCIe path class (SOC as SYS); GPUs
        with the same best NICs take them in order, the k-th GPU the k-th NIC (two GPUs sharing two NICs
        behind one switch on a DGX A100 take one each). Empty when the matrix has no NIC columns."""
        if not self.nics:
            return []
        classes: dict[int, dict[str, str]] = {}
        for g in self.gpus:
            row = classes[g] = {}
            for nic in self.nics:
                cell = self.cells[(f"GPU{g}", nic)]
                if cell not in PCIE_CELLS:
                    raise DiscoveryError(f"GPU{g}-{nic} is {cell}, which is not a PCIe path between a GPU and a NIC")
                row[nic] = "SYS" if cell == "SOC" else cell
        best: dict[int, tuple[str, ...]] = {}
        for g, row in classes.items():
            top = min(row.values(), key=PCIE_CELLS.index)
            best[g] = tuple(nic for nic in self.nics if row[nic] == top)
        out = []
        for g in self.gpus:
            peers = [p for p in self.gpus if best[p] == best[g]]
            nic = best[g][peers.index(g) % len(best[g])]
            out.append((g, nic, classes[g][nic]))
        return out

    def closest_level(self, nic: str) -> str:
        """The best connection a NIC has to any GPU (e.g. SYS when it is far from all)."""
        order = ["PIX", "PXB", "PXN", "PHB", "NODE", "SYS", "SOC"]
        return min((self.cells[(nic, f"GPU{g}")] for g in self.gpus), key=order.index)


def _is_cell(value: str) -> bool:
    return value in CONNECTIONS or _NVLINK_CELL.match(value) is not None


def _tokens(line: str) -> list[str]:
    for phrase, token in _MULTIWORD.items():
        line = line.replace(phrase, token)
    return line.split()


def _node_list(text: str, where: str) -> list[int]:
    """'0,3-9,11-17' -> [0, 3, 4, ..., 17]; 'N/A' -> []."""
    if text in ("N/A", ""):
        return []
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise DiscoveryError(f"{where}: NUMA affinity {text!r} is not a node list like '0' or '0,3-9'")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def parse_topo_matrix(text: str, source: str = "topo -m") -> TopoMatrix:
    """Parse `nvidia-smi topo -m` (tab- or space-aligned; NIC columns with a NIC Legend or named mlx5_N)."""
    lines = text.splitlines()
    header_at = next((i for i, line in enumerate(lines) if "GPU0" in line.split()), None)
    if header_at is None:
        raise DiscoveryError(f"{source}: no header line with a GPU0 column; is this `nvidia-smi topo -m` output?")
    header = _tokens(lines[header_at])
    extras = [h for h in header if h in _MULTIWORD.values()]
    devices = [h for h in header if h not in _MULTIWORD.values()]
    if header[: len(devices)] != devices:
        raise DiscoveryError(f"{source}: line {header_at + 1}: device columns must come before the affinity columns")
    cells: dict[tuple[str, str], str] = {}
    rows: dict[str, list[str]] = {}
    row_at = header_at + 1
    while row_at < len(lines) and lines[row_at].strip() and not lines[row_at].startswith("Legend"):
        tokens = lines[row_at].split()
        name = tokens[0]
        where = f"{source}: line {row_at + 1} ({name})"
        if name not in devices:
            raise DiscoveryError(f"{where}: row device {name!r} is not a column of the header")
        values = tokens[1 : 1 + len(devices)]
        cells_found = next((i for i, v in enumerate(values) if not _is_cell(v)), len(values))
        expected_fields = len(devices) + (len(extras) if _GPU.match(name) else 0)
        if cells_found < len(devices) and len(tokens) - 1 < expected_fields:
            raise DiscoveryError(f"{where}: {cells_found} connection cells, expected {len(devices)}")
        for col, value in zip(devices, values, strict=True):
            if not _is_cell(value):
                raise DiscoveryError(f"{where}: unknown connection {value!r} to {col}; expected X, NV#, PIX, PXB, PHB, NODE or SYS")
            if (value == "X") != (col == name):
                raise DiscoveryError(f"{where}: cell for {col} is {value!r}; X must be exactly on the diagonal")
            cells[(name, col)] = value
        rows[name] = tokens[1 + len(devices) :]
        row_at += 1
    missing = [d for d in devices if d not in rows]
    if missing:
        raise DiscoveryError(f"{source}: no rows for devices {missing}")
    for (a, b), value in cells.items():
        if cells[(b, a)] != value:
            raise DiscoveryError(f"{source}: {a}->{b} is {value} but {b}->{a} is {cells[(b, a)]}; the matrix must be symmetric")
    gpu_cols = [d for d in devices if _GPU.match(d)]
    nic_cols = [d for d in devices if not _GPU.match(d)]
    legend = parse_nic_legend(lines[row_at:], source)
    unknown = sorted(set(legend) - set(nic_cols))
    if unknown:
        raise DiscoveryError(f"{source}: NIC Legend names {unknown}, which are not columns of the matrix")
    rename = {col: legend.get(col, col) for col in nic_cols}
    matrix = TopoMatrix(
        gpus=[int(_GPU.match(d).group(1)) for d in gpu_cols],  # type: ignore[union-attr]
        nics=[rename[c] for c in nic_cols],
        cells={(rename.get(a, a), rename.get(b, b)): v for (a, b), v in cells.items()},
    )
    for col in gpu_cols:
        gpu = int(col[3:])
        values = dict(zip(extras, rows[col], strict=False))
        where = f"{source}: {col}"
        if "CPU_Affinity" in values:
            matrix.cpu_affinity[gpu] = values["CPU_Affinity"]
        matrix.numa_affinity[gpu] = _node_list(values.get("NUMA_Affinity", "N/A"), where)
        numa_id = values.get("GPU_NUMA_ID", "N/A")
        if numa_id != "N/A":
            if not numa_id.isdigit():
                raise DiscoveryError(f"{where}: GPU NUMA ID {numa_id!r} is not a number or N/A")
            matrix.gpu_numa_id[gpu] = int(numa_id)
    return matrix


def parse_nic_legend(lines: list[str], source: str = "topo -m") -> dict[str, str]:
    """The 'NIC Legend:' block: column name (NIC0) -> device (mlx5_0). Empty when there is none."""
    out: dict[str, str] = {}
    inside = False
    for line in lines:
        if line.strip() == "NIC Legend:":
            inside = True
            continue
        if inside and line.strip():
            name, sep, device = line.strip().partition(":")
            if not sep or not device.strip() or not re.match(r"^NIC\d+$", name):
                raise DiscoveryError(f"{source}: NIC Legend line {line.strip()!r} is not 'NICn: device'")
            out[name] = device.strip()
    return out


@dataclass
class NvlinkStatus:
    """`nvidia-smi nvlink -s` for one GPU."""

    gpu: int
    name: str
    uuid: str | None
    links: dict[int, float | None]
    """Link index -> GB/s per direction, None when the link is inactive."""

    @property
    def active_links(self) -> int:
        return sum(1 for rate in self.links.values() if rate is not None)

    @property
    def bandwidth_gbytes_per_s(self) -> float:
        """Sum over active links, GB/s per direction."""
        return sum(rate for rate in self.links.values() if rate is not None)


_NVLINK_GPU = re.compile(r"^GPU (\d+): (.*?)(?: \(UUID: ([^)]*)\))?$")
_NVLINK_LINK = re.compile(r"^Link (\d+): (?:([\d.]+) GB/s|<inactive>)$")


def parse_nvlink_status(text: str, source: str = "nvlink -s") -> list[NvlinkStatus]:
    """Parse `nvidia-smi nvlink -s` (one section per GPU, one line per link)."""
    out: list[NvlinkStatus] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        gpu = _NVLINK_GPU.match(line)
        if gpu:
            out.append(NvlinkStatus(gpu=int(gpu.group(1)), name=gpu.group(2), uuid=gpu.group(3), links={}))
            continue
        link = _NVLINK_LINK.match(line)
        if link is None:
            raise DiscoveryError(f"{source}: line {number}: {line!r} is neither 'GPU n: name' nor 'Link n: <rate> GB/s'")
        if not out:
            raise DiscoveryError(f"{source}: line {number}: link line before any 'GPU n:' header")
        out[-1].links[int(link.group(1))] = float(link.group(2)) if link.group(2) else None
    if not out:
        raise DiscoveryError(f"{source}: no 'GPU n:' sections")
    return out


@dataclass(frozen=True)
class FabricInfo:
    """NVLink fabric registration of one GPU (multi-node NVLink: GB200 NVL72 and the like)."""

    gpu: int
    cluster_uuid: str | None
    clique_id: int | None

    @property
    def domain(self) -> str | None:
        """'<cluster uuid>.<clique id>', the NVLink domain key; None when the GPU is not in a fabric."""
        if self.cluster_uuid is None or self.clique_id is None:
            return None
        return f"{self.cluster_uuid}.{self.clique_id}"


def parse_fabric_query(text: str, source: str = "fabric query") -> list[FabricInfo]:
    """Parse `nvidia-smi --query-gpu=index,fabric.clusterUuid,fabric.cliqueId --format=csv`."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise DiscoveryError(f"{source}: empty")
    header = [h.strip() for h in lines[0].split(",")]
    wanted = ("index", "fabric.cluster_uuid", "fabric.clique_id")
    aliases = {"fabric.clusterUuid": "fabric.cluster_uuid", "fabric.cliqueId": "fabric.clique_id"}
    header = [aliases.get(h, h) for h in header]
    if any(w not in header for w in wanted):
        raise DiscoveryError(f"{source}: header {lines[0]!r} lacks one of {', '.join(wanted)}")
    out = []
    for number, line in enumerate(lines[1:], 2):
        values = dict(zip(header, (v.strip() for v in line.split(",")), strict=False))
        if len(line.split(",")) != len(header) or not values["index"].isdigit():
            raise DiscoveryError(f"{source}: line {number}: {line!r} does not match the header {lines[0]!r}")
        uuid = values["fabric.cluster_uuid"]
        clique = values["fabric.clique_id"]
        absent = {"N/A", "[N/A]", "", "00000000-0000-0000-0000-000000000000"}
        if clique not in absent and not clique.isdigit():
            raise DiscoveryError(f"{source}: line {number}: clique id {clique!r} is not a number or N/A")
        out.append(
            FabricInfo(
                gpu=int(values["index"]),
                cluster_uuid=None if uuid in absent else uuid,
                clique_id=None if clique in absent else int(clique),
            )
        )
    return out


@dataclass(frozen=True)
class IbPort:
    """One InfiniBand / RoCE port as sysfs (or ibstat) reports it."""

    device: str
    port: int
    rate_gbps: float | None
    state: str | None
    """ACTIVE, DOWN, INIT, ... (sysfs spelling, upper case)."""
    link_layer: str | None
    """InfiniBand or Ethernet."""
    phys_state: str | None = None


_RATE = re.compile(r"^([\d.]+) Gb/sec")


def _sysfs_value(name: str, value: str, where: str) -> object:
    value = value.strip()
    if name == "rate":
        match = _RATE.match(value)
        if match is None:
            raise DiscoveryError(f"{where}: rate {value!r} is not like '400 Gb/sec (4X NDR)'")
        return float(match.group(1))
    if name in ("state", "phys_state"):
        _, _, label = value.partition(": ")
        if not label:
            raise DiscoveryError(f"{where}: {name} {value!r} is not like '4: ACTIVE'")
        return label.upper()
    if name == "link_layer":
        if value not in ("InfiniBand", "Ethernet"):
            raise DiscoveryError(f"{where}: link_layer {value!r} is neither InfiniBand nor Ethernet")
        return value
    return None


def _ports_from_values(values: dict[tuple[str, int], dict[str, object]]) -> list[IbPort]:
    return [
        IbPort(
            device=dev,
            port=port,
            rate_gbps=v.get("rate"),  # type: ignore[arg-type]
            state=v.get("state"),  # type: ignore[arg-type]
            link_layer=v.get("link_layer"),  # type: ignore[arg-type]
            phys_state=v.get("phys_state"),  # type: ignore[arg-type]
        )
        for (dev, port), v in sorted(values.items())
    ]


_ATTRS = ("rate", "state", "phys_state", "link_layer")


def read_ib_sysfs(root: str | Path) -> list[IbPort]:
    """Read `<root>/<device>/ports/<n>/{rate,state,phys_state,link_layer}` (root: /sys/class/infiniband)."""
    root = Path(root)
    if not root.is_dir():
        raise DiscoveryError(f"{root}: not a directory (expected a /sys/class/infiniband tree)")
    values: dict[tuple[str, int], dict[str, object]] = {}
    for port_dir in sorted(root.glob("*/ports/*")):
        if not port_dir.name.isdigit():
            raise DiscoveryError(f"{port_dir}: port directory names are numbers")
        key = (port_dir.parent.parent.name, int(port_dir.name))
        for attr in _ATTRS:
            f = port_dir / attr
            if f.is_file():
                values.setdefault(key, {})[attr] = _sysfs_value(attr, f.read_text(), str(f))
    if not values:
        raise DiscoveryError(f"{root}: no <device>/ports/<n>/ attributes found")
    return _ports_from_values(values)


def parse_ib_sysfs_listing(text: str, source: str = "sysfs listing") -> list[IbPort]:
    """The same from `grep . */ports/*/*` output: lines 'mlx5_0/ports/1/rate:400 Gb/sec (4X NDR)'."""
    values: dict[tuple[str, int], dict[str, object]] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        path, sep, value = line.partition(":")
        parts = path.split("/")
        where = f"{source}: line {number}"
        if not sep or len(parts) != 4 or parts[1] != "ports" or not parts[2].isdigit():
            raise DiscoveryError(f"{where}: {line!r} is not '<device>/ports/<n>/<attribute>:<value>'")
        if parts[3] in _ATTRS:
            values.setdefault((parts[0], int(parts[2])), {})[parts[3]] = _sysfs_value(parts[3], value, where)
    if not values:
        raise DiscoveryError(f"{source}: no port attributes")
    return _ports_from_values(values)


def parse_ibstat(text: str, source: str = "ibstat") -> list[IbPort]:
    """Parse `ibstat` output: CA blocks with Port sections (State, Physical state, Rate, Link layer)."""
    values: dict[tuple[str, int], dict[str, object]] = {}
    device: str | None = None
    port: int | None = None
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        ca = re.match(r"^CA '([^']+)'$", line)
        if ca:
            device, port = ca.group(1), None
            continue
        header = re.match(r"^Port (\d+):$", line)
        if header:
            if device is None:
                raise DiscoveryError(f"{source}: line {number}: port section before any CA")
            port = int(header.group(1))
            values.setdefault((device, port), {})
            continue
        key, sep, value = line.partition(":")
        if port is None or not sep or device is None:
            continue
        value = value.strip()
        where = f"{source}: line {number}"
        if key == "Rate":
            try:
                values[(device, port)]["rate"] = float(value)
            except ValueError:
                raise DiscoveryError(f"{where}: Rate {value!r} is not a number") from None
        elif key == "State":
            values[(device, port)]["state"] = value.upper()
        elif key == "Physical state":
            values[(device, port)]["phys_state"] = value.upper()
        elif key == "Link layer":
            values[(device, port)]["link_layer"] = value
    if not values:
        raise DiscoveryError(f"{source}: no CA / Port sections")
    return _ports_from_values(values)
