"""Every private name of Ray that ray-elastic uses, and nothing else: an upgrade past Ray 2.60 is this file's work.

Ray offers no public call for what these read or change (each docstring
says what, and why no public API does). Every other module calls these
functions, never `ray._private`, `ray.experimental.internal_kv`'s
underscored functions or an underscored attribute of a Ray object;
`tests/unit/test_ray_private.py` checks each name on the installed Ray
(it exists, with the shape used here) and that no other module of
`ray_elastic` reaches past this one. Ray Data's private names stay with
the module that uses them, `data/batches.py` (its `RAY_NAMES`, checked
by `tests/unit/test_data_batches.py`).

Each function is the call it replaces, unchanged: same arguments, same
result, same exceptions. Ray is imported inside each function, so this
module costs nothing to import (the CLI and a worker's start import it).
"""

from __future__ import annotations

from typing import Any

# ---- the GCS's key-value store (`ray.experimental.internal_kv`) --------------------------------------------------
# Ray's only client of the GCS KV; no public API reaches it. Each needs a connected Ray (`ray.init`, or inside a
# worker) and raises Ray's error otherwise.


def kv_put(key: str | bytes, value: str | bytes, overwrite: bool = True, *, namespace: str | None = None) -> bool:
    """`value` under `key` in the GCS's KV (`_internal_kv_put`); whether the key was there already."""
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_put(key, value, overwrite, namespace=namespace)


def kv_get(key: str | bytes, *, namespace: str | bytes | None = None) -> bytes | None:
    """The bytes under `key` in the GCS's KV, or None (`_internal_kv_get`)."""
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_get(key, namespace=namespace)


def kv_del(key: str | bytes, *, namespace: str | None = None) -> int:
    """Delete `key` from the GCS's KV (`_internal_kv_del`); how many keys were deleted."""
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_del(key, namespace=namespace)


def kv_exists(key: str | bytes, *, namespace: str | None = None) -> bool:
    """Whether `key` is in the GCS's KV (`_internal_kv_exists`)."""
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_exists(key, namespace=namespace)


def kv_list(prefix: str | bytes, *, namespace: str | None = None) -> list[bytes]:
    """The keys of the GCS's KV that start with `prefix` (`_internal_kv_list`)."""
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_list(prefix, namespace=namespace)


# ---- the GCS's tables (`ray._private.state`) ---------------------------------------------------------------------


def actor_record(actor_id: str) -> dict[str, Any]:
    """The GCS's record of one actor by hex id (`ray._private.state.actors`): "State", "NumRestarts", "Pid", ...

    `ray.util.state.get_actor` reads the same record through the dashboard's
    state API, which needs the dashboard up and answers over HTTP; this asks
    the GCS directly, as `was_current_actor_reconstructed` does. Empty for an
    id the GCS does not know.
    """
    import ray

    return ray._private.state.actors(actor_id)


def actor_state(actor_id: str) -> str | None:
    """The actor's state in the GCS ("ALIVE", "RESTARTING", "DEAD", ...), from `actor_record`."""
    return actor_record(actor_id).get("State")


def draining_nodes() -> dict[str, int]:
    """`{node id: drain deadline in ms since the epoch}` of the nodes Ray is draining (a preemption notice,
    `ray drain-node`); no public API lists them (`ray.nodes()` does not show a node draining)."""
    import ray

    return ray._private.state.state.get_draining_nodes()


def available_resources_per_node() -> dict[str, dict[str, float]]:
    """`{node id: its free resources}` (`ray._private.state.available_resources_per_node`).

    `ray.available_resources()` gives only the cluster's sum; the per-node
    figure is what decides where one more worker's bundle fits.
    """
    import ray

    return ray._private.state.available_resources_per_node()


def dashboard_url() -> str | None:
    """The HTTP address of the connected cluster's dashboard (the state API's server); None when it runs none.

    Read from the GCS's KV, where the dashboard writes it
    (`ray_constants.DASHBOARD_ADDRESS` in `KV_NAMESPACE_DASHBOARD`). Given no
    address, the state API finds its cluster from the environment instead:
    `RAY_ADDRESS`, else the last `ray start`'s address file, else a scan of
    the machine's processes, which from inside a worker can name another
    cluster of the machine or a stopped one, and it re-binds the calling
    process's KV client to whatever it found. Passed this address, it still
    takes `RAY_ADDRESS` over it where the process's environment sets one
    (as `ray.init` does): Ray's documented rule, left as it is. No public
    call names the connected cluster's dashboard.
    """
    from ray._private import ray_constants

    url = kv_get(ray_constants.DASHBOARD_ADDRESS, namespace=ray_constants.KV_NAMESPACE_DASHBOARD)
    return None if not url else f"http://{url.decode()}"


# ---- an actor handle ---------------------------------------------------------------------------------------------


def actor_id_of(handle: Any) -> str:
    """The hex id of the actor behind `handle` (`ActorHandle._actor_id`).

    A handle shows its id only privately; the public
    `get_runtime_context().get_actor_id()` gives only the calling actor's own.
    """
    return handle._actor_id.hex()


# ---- this process's Ray worker (`ray._private.worker`) -----------------------------------------------------------


def global_node() -> Any:
    """This process's Ray node object (`ray._private.worker._global_node`), None when not connected.

    It knows the session's log directory (`get_logs_dir_path()`); no public
    API names that directory.
    """
    import ray

    return getattr(ray._private.worker, "_global_node", None)


def worker_mode() -> int:
    """This process's Ray mode (`global_worker.mode`), to compare with `ray.WORKER_MODE` / `ray.SCRIPT_MODE`.

    The runtime context tells a task from an actor, not a Ray worker process
    from the process that called `ray.init`.
    """
    import ray

    return ray._private.worker.global_worker.mode


def job_config() -> Any:
    """The job's config as this process's core worker holds it (its `py_driver_sys_path`: where the job's modules
    are imported from); the public runtime context does not carry it. Raises when not connected."""
    import ray

    return ray._private.worker.global_worker.core_worker.get_job_config()


# ---- the terminal output Ray forwards from its workers (`ray._private.ray_logging`) -------------------------------
# `ray.init(log_to_driver=...)` only turns the forwarding on or off; the handler that prints it and the
# deduplicator that merges repeated lines have no public API. Both raise ImportError on a Ray without them.


def stdstream_dispatcher() -> Any:
    """The dispatcher of the workers' forwarded output (`global_worker_stdstream_dispatcher`): its `handlers`
    (`[(name, handler)]`, "ray_print_logs" the one `ray.init` installs), `add_handler`, `remove_handler`."""
    from ray._private.ray_logging import global_worker_stdstream_dispatcher

    return global_worker_stdstream_dispatcher


def output_deduplicators() -> tuple[Any, Any]:
    """The deduplicators of the workers' forwarded stdout and stderr, in that order (their `skip_re`: lines never
    merged)."""
    from ray._private.ray_logging import stderr_deduplicator, stdout_deduplicator

    return stdout_deduplicator, stderr_deduplicator


# ---- Ray Train's DataConfig (`ray.train.DataConfig`) ----------------------------------------------------------
# It keeps its arguments in private attributes: Ray 2.60 has no public getters for them.


def datasets_to_split(config: Any) -> Any:
    """`DataConfig(datasets_to_split=...)` as given: "all", or the names of the datasets split across workers."""
    return config._datasets_to_split


def execution_options_of(config: Any, name: str) -> Any:
    """`DataConfig(execution_options=...)` for dataset `name` (one for all, or one per name), or None."""
    return config._get_user_execution_options(name)
