"""One soak-style digits run on a cluster of its own, for the whole-cluster-loss test.

    python tests/support/resume_run.py --checkpoint-dir D --ledger-dir L --attempt 0 --lose-cluster-after-commit 10
    python tests/support/resume_run.py --checkpoint-dir D --ledger-dir L --attempt 1

The first form trains until the durable checkpoint in D has reached the given
commit, then kills every process of its cluster at once (head included) and
exits with status 3: the run is lost as if the machines went away. The second
form starts a new cluster, resumes from D and prints the result as one JSON
line, which `tests/integration/test_checkpoint_cluster.py` checks together with the ledger.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from soak import soak_train_fn  # noqa: E402

import ray_elastic as elastic  # noqa: E402
from ray_elastic.checkpoint import CheckpointStore  # noqa: E402

LOST_EXIT_CODE = 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--ledger-dir", required=True)
    parser.add_argument("--attempt", type=int, required=True)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lose-cluster-after-commit", type=int)
    args = parser.parse_args()

    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, logging_level=logging.WARNING)
    cluster.wait_for_nodes()
    trainer = elastic.ElasticTrainer(
        soak_train_fn,
        2,
        2,
        config={"seed": 0, "lr": 0.05, "epochs": args.epochs, "ledger_dir": args.ledger_dir, "attempt": args.attempt},
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=2,
        verbose=0,
    )
    if args.lose_cluster_after_commit is not None:
        threading.Thread(
            target=_lose_cluster_at, args=(cluster, args.checkpoint_dir, args.lose_cluster_after_commit), daemon=True
        ).start()
    result = trainer.fit()
    ray.shutdown()
    cluster.shutdown()
    print(
        json.dumps(
            {
                "epochs": result.return_value["epochs"],
                "digests": result.return_value["digests"],
                "n": result.return_value["n"],
                "events": [e.to_dict() for e in result.events],
                "first_step": result.metrics_history[0]["step"],
            }
        )
    )


def _lose_cluster_at(cluster: object, checkpoint_dir: str, commit: int) -> None:
    store = CheckpointStore(checkpoint_dir)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        meta = store.meta() if store.exists() else None
        if meta is not None and meta["commit"] >= commit:
            for node in list(cluster.worker_nodes):
                node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
            cluster.head_node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
            os._exit(LOST_EXIT_CODE)
        time.sleep(0.05)
    os._exit(1)  # the checkpoint never reached the commit: the caller reports it


if __name__ == "__main__":
    main()
