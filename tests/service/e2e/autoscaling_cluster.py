"""Ray's autoscaling test cluster (`ray.cluster_utils.AutoscalingCluster`: the real autoscaler, nodes
simulated by its fake multi-node provider) on loopback, started and stopped by this process alone.

`AutoscalingCluster.start()` and `shutdown()` run `ray stop --force`, which stops every Ray on the
machine, and read a config template Ray's wheel does not ship; `LoopbackAutoscalingCluster` keeps the
class's config and environment and replaces both: its head is a `ray start --head --block` in a session
of its own, and `shutdown` ends every process of that session (the autoscaler's fake nodes run in it)
by PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID
from ray.cluster_utils import AutoscalingCluster

from trainctl.workers.rank_worker import free_port

BIN = Path(sys.executable).parent
FAKE_PROVIDER = "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider"
"""Ray's fake multi-node provider, named as an external one: as `fake_multinode` Ray reads its defaults
from fake_multi_node/example.yaml, which its wheel does not ship."""
LOOPBACK = "127.0.0.1"


def session_processes(session: int) -> set[int]:
    """The live processes of session `session` (from /proc)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if len(fields) > 3 and fields[0] != "Z" and int(fields[3]) == session:
            found.add(int(entry.name))
    return found


class LoopbackAutoscalingCluster(AutoscalingCluster):
    """An autoscaling cluster on 127.0.0.1 with free ports, running Ray's autoscaler v2 (which honours
    the label selectors of a resource request); `idle_timeout_minutes` (fractions allowed) is how long an
    idle node stays."""

    def __init__(self, head_resources: dict[str, float], worker_node_types: dict[str, Any], *,
                 idle_timeout_minutes: float, workdir: Path):
        self.port = free_port(LOOPBACK)
        self.workdir = workdir
        self.head: subprocess.Popen | None = None
        super().__init__(head_resources, worker_node_types, autoscaler_v2=True, idle_timeout_minutes=idle_timeout_minutes)

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def _generate_config(self, head_resources: dict[str, float], worker_node_types: dict[str, Any],
                         autoscaler_v2: bool = False, **config_kwargs: Any) -> dict[str, Any]:
        """The fake multi-node config (what Ray's fake_multi_node/example.yaml holds, with what
        `AutoscalingCluster` sets for autoscaler v2), its worker nodes joining this cluster's GCS."""
        return {
            "cluster_name": "trainctl-autoscaling-test",
            "max_workers": sum(t.get("max_workers", 0) for t in worker_node_types.values()),
            "provider": {"type": "external", "module": FAKE_PROVIDER, "use_node_id_as_ip": True, "disable_node_updaters": True,
                         "disable_launch_config_check": True, "gcs_address": self.address,
                         "launch_multiple": True, "head_node_id": FAKE_HEAD_NODE_ID},
            "available_node_types": {
                **worker_node_types,
                "ray.head.default": {"resources": dict(head_resources), "node_config": {}, "max_workers": 0},
            },
            "head_node_type": "ray.head.default",
            "upscaling_speed": 1.0,
            "docker": {}, "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
            "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
            "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
            "rsync_exclude": [], "rsync_filter": [], "auth": {},
            **config_kwargs,
        }

    def start(self, _system_config: dict[str, Any] | None = None, override_env: dict[str, str] | None = None,
              within: float = 90.0) -> None:
        """Start the head (and with it the autoscaler) and wait until it blocks."""
        config = self.workdir / "autoscaling.json"
        config.write_text(json.dumps(self._config))
        resources = dict(self._head_resources)
        cpus = int(resources.pop("CPU", 0))
        temp = self.workdir / "ray"
        args = [str(BIN / "ray"), "start", "--head", "--block", f"--autoscaling-config={config}",
                f"--node-ip-address={LOOPBACK}", f"--port={self.port}", f"--num-cpus={cpus}",
                f"--resources={json.dumps(resources)}", "--include-dashboard=false", f"--temp-dir={temp}",
                f"--ray-client-server-port={free_port(LOOPBACK)}",
                f"--dashboard-agent-listen-port={free_port(LOOPBACK)}",
                f"--dashboard-agent-grpc-port={free_port(LOOPBACK)}",
                f"--runtime-env-agent-port={free_port(LOOPBACK)}", f"--metrics-export-port={free_port(LOOPBACK)}",
                f"--node-manager-port={free_port(LOOPBACK)}", f"--object-manager-port={free_port(LOOPBACK)}"]
        env = {**os.environ, "AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_FAKE_CLUSTER": "1",
               "RAY_AUTH_MODE": "disabled", "RAY_enable_autoscaler_v2": "1", "RAY_CLOUD_INSTANCE_ID": FAKE_HEAD_NODE_ID,
               "RAY_OVERRIDE_NODE_ID_FOR_TESTING": FAKE_HEAD_NODE_ID, **(override_env or {})}
        self.log = self.workdir / "ray-head.log"
        with self.log.open("w") as out:
            self.head = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + within
        while "block forever" not in (text := self.log.read_text()) and "blocks forever" not in text:
            if self.head.poll() is not None or time.monotonic() > deadline:
                self.shutdown()
                raise RuntimeError(f"the autoscaling Ray head did not start:\n{text[-3000:]}")
            time.sleep(0.2)

    def processes(self) -> set[int]:
        """Every live process the cluster runs: its head's session, fake nodes included."""
        return set() if self.head is None else session_processes(self.head.pid)

    def shutdown(self, grace: float = 10.0) -> None:
        """SIGTERM the head (`ray start` stops the processes it started), then SIGKILL whatever of its
        session is left after `grace` seconds (a fake node the autoscaler still runs)."""
        if self.head is None:
            return
        self.head.terminate()
        if not self._emptied(grace):
            for pid in self.processes():
                with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                    os.kill(pid, signal.SIGKILL)
            self._emptied(grace)
        self.head.wait(timeout=grace)

    def _emptied(self, within: float) -> bool:
        """Whether the head's session has no live process left within `within` seconds."""
        deadline = time.monotonic() + within
        while self.processes() and time.monotonic() < deadline:
            self.head.poll()  # reap the head once it exits
            time.sleep(0.1)
        return not self.processes()
