"""The cluster's topology: the map (versioned YAML), its validation, and discovery on nodes."""

from trainctl.workers.topology.model import TopologyError, TopologyMap, load_topology, simulated_topology

__all__ = ["TopologyError", "TopologyMap", "load_topology", "simulated_topology"]
