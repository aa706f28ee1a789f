"""Give the benchmark's local Ray its own dashboard and point Ray Train's state queries at it.

Ray Train v2 starts a detached `PlacementGroupCleaner` per run that asks the
State API (through a dashboard) whether the run's controller is still alive,
and removes the run's placement group when it is not. It finds the dashboard
by auto-detection; on a machine where other Ray instances run (other agents'
test clusters here) it can ask another cluster, which knows nothing of our
controller, and then removes a live run's placement group (seen here: a
`TorchTrainer` failing with "Destroying worker since its placement group was
removed"). Fixing the dashboard's port and exporting it as
`RAY_API_SERVER_ADDRESS` before Ray starts (its processes inherit the
environment) makes the cleaner ask our own cluster, as on a machine of one's
own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from typing import Any


def own_dashboard() -> dict[str, Any]:
    """Start-up arguments for `ray.init(address="local", ...)` or a `Cluster` head; sets the variable."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"
    return {"include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": port}


@contextlib.contextmanager
def local_cluster(nodes: int = 2, cpus: int = 2) -> Iterator[tuple[Any, list[Any]]]:
    """A local cluster (a head without CPUs, with its own dashboard, and `nodes` nodes of `cpus` CPUs), connected."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, **own_dashboard()})
    added = [cluster.add_node(num_cpus=cpus) for _ in range(nodes)]
    ray.init(address=cluster.address, logging_level=logging.ERROR)
    cluster.wait_for_nodes()
    try:
        yield cluster, added
    finally:
        ray.shutdown()
        cluster.shutdown()
