"""Merge discovered node entries with a switch-tree file into one `TopologyMap`.

Discovery sees inside a node (GPUs, NVLink, NICs); only the platform team knows the cabling. The
switch-tree file (`kind: SwitchTree`) gives the fabric levels, the switches, and for each group of
nodes which leaf each rail goes to:

    apiVersion: trainctl/v1
    kind: SwitchTree
    metadata: {name: su-0}
    fabric: {nvlink: {...}, leaf: {...}, spine: {...}}
    switches: [{name: su0-rail0, tier: leaf, rail: 0, parent: spine-0}, ...]
    cabling:
      - nodes: [dgx-000, dgx-001]
        rails: {0: su0-rail0, 1: su0-rail1}   # rail-optimized: rail -> leaf
      - nodes: [pcie-0]
        leaf: tor-3                             # every compute NIC to one leaf
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from trainctl.spec import strict_yaml
from trainctl.spec.pydantic_violations import violations_from_pydantic
from trainctl.workers.topology.model import (
    Fabric,
    Metadata,
    Node,
    NvlinkDomain,
    Switch,
    TopologyError,
    TopologyMap,
    TopologySpec,
    parse_topology,
)


class Cabling(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    nodes: list[str] = Field(min_length=1)
    """Nodes cabled this way."""
    rails: dict[int, str] = Field(default_factory=dict)
    """Rail-optimized: rail -> leaf switch name."""
    leaf: str | None = None
    """Not rail-optimized: the leaf every compute NIC goes to."""

    @model_validator(mode="after")
    def _one_way(self) -> Cabling:
        if bool(self.rails) == (self.leaf is not None):
            raise ValueError(f"cabling of {self.nodes[:3]}...: give exactly one of `rails` or `leaf`")
        return self


class SwitchTree(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    apiVersion: Literal["trainctl/v1"] = "trainctl/v1"  # noqa: N815 - Kubernetes-style key
    kind: Literal["SwitchTree"] = "SwitchTree"
    metadata: Metadata
    """Name of the resulting map."""
    fabric: Fabric
    """Per-level bandwidth, latency and oversubscription."""
    switches: list[Switch] = Field(default_factory=list)
    """The switch tree."""
    cabling: list[Cabling] = Field(default_factory=list)
    """Which leaf each node's NICs are cabled to."""
    nvlink_domains: list[NvlinkDomain] = Field(default_factory=list)
    """Optional: domains with partitions; domains of discovered nodes are added automatically."""


def load_switch_tree(path: str | Path) -> SwitchTree:
    path = Path(path)
    try:
        data = strict_yaml.load(path.read_text())
        return SwitchTree.model_validate(data)
    except OSError as err:
        raise TopologyError(f"{path}: cannot read switch tree: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise TopologyError(f"{path}: not valid YAML: {err}") from None
    except ValidationError as err:
        raise TopologyError(f"{path}: {'; '.join(map(str, violations_from_pydantic(err)))}") from None


def merge(nodes: list[Node], tree: SwitchTree) -> TopologyMap:
    """One validated map: discovered nodes, cabled to the tree's leaves, grouped into NVLink domains."""
    by_name = {n.name: n for n in nodes}
    if len(by_name) != len(nodes):
        raise TopologyError("merge: two discovered node entries have the same name")
    cabling: dict[str, Cabling] = {}
    for entry in tree.cabling:
        for name in entry.nodes:
            if name not in by_name:
                raise TopologyError(f"merge: cabling names node {name!r}, which discovery did not report")
            if name in cabling:
                raise TopologyError(f"merge: node {name!r} is cabled twice")
            cabling[name] = entry
    cabled: list[Node] = []
    for node in nodes:
        if node.name not in cabling:
            raise TopologyError(f"merge: node {node.name!r} has no cabling entry in switch tree {tree.metadata.name!r}")
        entry = cabling[node.name]
        nics = []
        for nic in node.nics:
            if nic.rail is None:
                nics.append(nic)
                continue
            if entry.leaf is not None:
                nics.append(nic.model_copy(update={"leaf": entry.leaf, "rail": None}))
            elif nic.rail in entry.rails:
                nics.append(nic.model_copy(update={"leaf": entry.rails[nic.rail]}))
            else:
                raise TopologyError(
                    f"merge: node {node.name!r}: NIC {nic.name!r} is on rail {nic.rail}, which the cabling does not list "
                    f"(rails {sorted(entry.rails)})"
                )
        cabled.append(node.model_copy(update={"nics": nics}))
    declared = {d.name: d for d in tree.nvlink_domains}
    members: dict[str, list[str]] = {}
    for node in cabled:
        if node.nvlink_domain is not None:
            members.setdefault(node.nvlink_domain, []).append(node.name)
    domains = []
    for name, names in members.items():
        if name in declared and sorted(declared[name].nodes) != sorted(names):
            raise TopologyError(f"merge: NVLink domain {name!r} lists {declared[name].nodes} but discovery found {names}")
        domains.append(declared.get(name) or NvlinkDomain(name=name, nodes=names))
    spec = TopologySpec(fabric=tree.fabric, nvlink_domains=domains, switches=tree.switches, nodes=cabled)
    data = {"metadata": tree.metadata.model_dump(), "spec": spec.model_dump(mode="json")}
    return parse_topology(data, f"merge of {tree.metadata.name!r}")
