"""One `ElasticTrainer(counting_train_fn).fit()` on the cluster at RAY_ADDRESS, for tests/integration/test_netns.py.

    RAY_ADDRESS=... RAY_AUTH_MODE=token RAY_AUTH_TOKEN=... python tests/support/netns_fit.py '{"config": {...}, ...}'

The argument is a JSON object: `config` (for `counting_train_fn`, plus
`ip_dir`, where every worker writes the IP of the node it runs on, in a
file named after its worker id; `"workload": "fenced"` runs
`fenced_workload.fenced_train_fn` instead) and `trainer` (keyword arguments of
`ElasticTrainer`). Prints the result as one JSON line. It runs in a process
of its own because the test process is connected to the session's cluster,
and a process can be connected to one Ray cluster only.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from fenced_workload import fenced_train_fn  # noqa: E402
from workloads import counting_train_fn  # noqa: E402

import ray_elastic as elastic  # noqa: E402
from ray_elastic.runtime import current  # noqa: E402


def train_fn(config: dict) -> dict:
    """`counting_train_fn`, after noting which node's IP this worker runs on."""
    import ray

    (Path(config["ip_dir"]) / current().worker_id).write_text(ray.util.get_node_ip_address())
    if config.get("workload") == "fenced":
        return fenced_train_fn(config)
    return counting_train_fn(config)


def main() -> None:
    import ray

    spec = json.loads(sys.argv[1])
    ray.init(logging_level=logging.WARNING)  # the address and the token come from the environment
    kwargs = spec["trainer"]
    if "cooldown_range" in kwargs:
        kwargs["cooldown_range"] = tuple(kwargs["cooldown_range"])  # JSON has no tuples
    trainer = elastic.ElasticTrainer(train_fn, config=spec["config"], verbose=0, **kwargs)
    result = trainer.fit()
    nodes = [
        {"ip": n["NodeManagerAddress"], "alive": n["Alive"], "cpus": n["Resources"].get("CPU", 0)} for n in ray.nodes()
    ]
    ip_dir = Path(spec["config"]["ip_dir"])
    print(
        json.dumps(
            {
                "return_value": result.return_value,
                "metrics": result.metrics_history,
                "metric_times": result.metric_times,
                "events": [e.to_dict() for e in result.events],
                "nodes": nodes,
                "worker_ips": {p.name: p.read_text() for p in ip_dir.iterdir()},
            }
        )
    )
    ray.shutdown()


if __name__ == "__main__":
    main()
