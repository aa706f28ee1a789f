"""Shared fixtures: one local multi-node Ray cluster for the whole session.

The tests: `unit/` (no Ray, no processes of their own), `integration/` (a Ray
cluster, or a ring of real processes; each marked `integration` here), and
`support/` (their helpers, workloads and scripts; on `sys.path` from here).

The cluster (`ray.cluster_utils.Cluster`) has a head with no CPUs and two
nodes of 2 CPUs, so 4 worker slots on 2 hosts. Tests that add or remove nodes
put the cluster back as they found it. `no_leaks` checks after a test that
no actor and no placement group of any run is left.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import settings

sys.path.insert(0, str(Path(__file__).parent / "support"))

# hypothesis's 200 ms per-example deadline is a timing assertion: on a loaded 2-core machine (CI's, or tests run
# beside other work) it fails properties that hold; what the properties assert is the logic, never its speed
settings.register_profile("ray_elastic", deadline=None)
settings.load_profile("ray_elastic")
_INTEGRATION = Path(__file__).parent / "integration"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under integration/ is `-m integration`, marked there or not.

    The tests of the `ray start` cluster (Jobs, notebooks, the CLI) run last,
    together: that cluster idles beside the session's one from its first
    test to the session's end, and its processes took CPU from every test
    in between.
    """
    for item in items:
        if _INTEGRATION in item.path.parents:
            item.add_marker(pytest.mark.integration)
    items.sort(key=lambda item: "ray_start_cluster" in getattr(item, "fixturenames", ()))


# what a worker, a ring or Ray reads of its environment (libraries' own caches, set on import, aside)
_READ_BY_WORKERS = re.compile(
    r"(HOROVOD_|RAY_|GLOO_|NCCL_|TORCH_DISTRIBUTED|MASTER_|CUDA_VISIBLE|OMP_NUM_THREADS$|(LOCAL_)?RANK$|WORLD_SIZE$)"
)


@pytest.fixture(autouse=True)
def _environment_left_as_found(request):
    """A unit test leaves `os.environ` as it found it: the session's Ray cluster, started
    after the unit tests, hands its environment to every worker (a leaked HOROVOD_RANK=0
    once gave every rank of a later cluster test rank 0's place)."""
    before = {k: v for k, v in os.environ.items() if _READ_BY_WORKERS.match(k)}
    yield
    if _INTEGRATION in request.node.path.parents:
        return  # ray.init and Ray's own fixtures set variables for the session
    changed = sorted(
        k for k in set(before) | set(os.environ) if _READ_BY_WORKERS.match(k) and before.get(k) != os.environ.get(k)
    )
    if changed:
        for k in changed:
            if k in before:
                os.environ[k] = before[k]
            else:
                del os.environ[k]
        pytest.fail(f"the test left environment variables changed: {changed} (use monkeypatch.setenv)")


def _no_auto_init() -> None:
    """No call in this process starts a Ray of its own: only the `cluster` fixture's `ray.init` connects it.

    Ray's auto-init (`ray.get`, `ray.put`, `.remote` before any `ray.init`)
    starts a whole local cluster. A unit test's background thread once did
    so after the test ended (a metrics shipper whose patched `ray.get` had
    been put back): that `ray.init` set `RAY_AUTH_MODE=token` in this
    process mid-way through a later unit test, and the session cluster
    started after it died of Ray's `InvalidAuthToken`. With auto-init off,
    such a call raises "Ray has not been started yet" in the thread that
    made it. (A private switch of Ray's, read once at its import.)
    """
    import ray._private.auto_init_hook as auto_init_hook

    auto_init_hook.enable_auto_connect = False


_no_auto_init()

# a unit test's thread that talks to Ray (the metrics shipper's) must end with its test: it outlives
# the test's patches of `ray`, and its next call reaches the real one
_RAY_TALKING_THREADS = re.compile(r"ray-elastic-metrics")


@pytest.fixture(autouse=True)
def _no_ray_thread_left(request):
    """A unit test ends every thread it started that calls Ray (`WorkerContext.shutdown()` ends the shipper's)."""
    if _INTEGRATION in request.node.path.parents:
        yield
        return
    before = {t.ident for t in threading.enumerate()}
    yield
    left = [t.name for t in threading.enumerate() if t.ident not in before and _RAY_TALKING_THREADS.match(t.name)]
    if left:
        pytest.fail(f"the test left threads that call Ray running: {left} (shut its WorkerContext down)")


def wait_until(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.05) -> object:
    """Poll `predicate` until truthy; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def written_lines(path: Path) -> list[str]:
    """The lines a live run has finished writing to `path`: an unterminated last line is left for the next read.

    A worker's `write(line + "\\n")` can be seen half done by a reader polling
    the file meanwhile (a healed-partition test once read half a JSON line).
    """
    if not path.exists():
        return []
    text = path.read_text()
    return text[: text.rfind("\n") + 1].splitlines()


def run_namespaces_alive() -> list[dict]:
    import ray

    return [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"].startswith("ray_elastic_")]


def actor_pid(name: str, namespace: str) -> int:
    """The process id of a run's named actor, from Ray's actor table (its own methods want the run's token).

    `LookupError` while the actor has no process (pending or restarting):
    Ray's table then says pid 0, and `os.kill(0, SIGKILL)` would kill the
    test's own process group, the whole pytest run with it.
    """
    import ray

    actor_id = ray.get_actor(name, namespace=namespace)._actor_id.hex()
    pid = ray._private.state.actors(actor_id)["Pid"]
    if not isinstance(pid, int) or pid <= 0:
        raise LookupError(f"actor {name} of {namespace} has no process (pid {pid!r})")
    return pid


def run_placement_groups_alive() -> list[str]:
    from ray.util.placement_group import placement_group_table

    return [
        info["name"]
        for info in placement_group_table().values()
        if info.get("name", "").startswith("ray_elastic_") and info.get("state") != "REMOVED"
    ]


@pytest.fixture(scope="session")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    workers = [c.add_node(num_cpus=2) for _ in range(2)]
    ray.init(address=c.address, logging_level=logging.WARNING)
    c.wait_for_nodes()
    c.worker_nodes_at_start = workers
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture
def no_leaks(cluster):
    yield
    wait_until(lambda: not run_namespaces_alive(), 30, f"run actors to go away: {run_namespaces_alive()}")
    wait_until(
        lambda: not run_placement_groups_alive(), 30, f"run placement groups to go: {run_placement_groups_alive()}"
    )


@pytest.fixture(scope="session")
def _ray_start_clusters():
    """The session's `ray start` clusters: one, unless its dashboard died and a new one replaced it."""
    clusters = []
    yield clusters
    for c in clusters:
        c.stop()


@pytest.fixture
def ray_start_cluster(_ray_start_clusters):
    """A `ray start --head` cluster with token auth, shared by the Jobs, notebook and CLI tests.

    Checked before each test: a cluster whose dashboard stopped answering is
    replaced, with a warning that says why, rather than failing every later test.
    """
    from ray_start import RayStartCluster

    if _ray_start_clusters:
        problem = _ray_start_clusters[-1].unhealthy()
        if problem is None:
            return _ray_start_clusters[-1]
        warnings.warn(f"the shared `ray start` cluster stopped answering; starting a new one: {problem}", stacklevel=1)
    _ray_start_clusters.append(RayStartCluster(num_cpus=3))
    return _ray_start_clusters[-1]
