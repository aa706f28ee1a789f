"""Ray's private names, fenced in `ray_elastic/ray_private.py`: each one is checked on the installed Ray (it exists,
with the shape we call it with), each function of ours is checked to reach it, and a scan of `ray_elastic/` fails
when a private name of Ray is used anywhere else. No test here connects to Ray."""

from __future__ import annotations

import ast
import inspect
import pathlib
from types import SimpleNamespace

import pytest
import ray
import ray._private.node
import ray._private.ray_constants
import ray._private.ray_logging
import ray._private.state
import ray._private.worker
from ray.experimental import internal_kv

from ray_elastic import ray_private

PACKAGE = pathlib.Path(ray_private.__file__).parent


def takes(fn, *args, **kwargs) -> None:
    """`fn` accepts the arguments ray_private passes it (TypeError, naming the parameter, if not)."""
    assert callable(fn)
    inspect.signature(fn).bind(*args, **kwargs)


# ---- one test per private name of Ray ----------------------------------------------------------------------------


def test_internal_kv_put_takes_key_value_overwrite_and_namespace():
    takes(internal_kv._internal_kv_put, b"key", b"value", True, namespace="ray_elastic")


def test_internal_kv_get_takes_key_and_namespace():
    takes(internal_kv._internal_kv_get, b"key", namespace="ray_elastic")


def test_internal_kv_del_takes_key_and_namespace():
    takes(internal_kv._internal_kv_del, b"key", namespace="ray_elastic")


def test_internal_kv_exists_takes_key_and_namespace():
    takes(internal_kv._internal_kv_exists, "key", namespace="ray_elastic")


def test_internal_kv_list_takes_a_prefix_and_namespace():
    takes(internal_kv._internal_kv_list, "autoscale:", namespace="ray_elastic")


def test_state_actors_takes_an_actor_id():
    takes(ray._private.state.actors, "ab" * 16)


def test_state_get_draining_nodes_is_a_method_of_the_global_state_taking_nothing():
    takes(ray._private.state.state.get_draining_nodes)


def test_state_available_resources_per_node_takes_nothing():
    takes(ray._private.state.available_resources_per_node)


def test_the_dashboard_writes_its_address_under_the_constants_we_read_it_by():
    """The dashboard's own lookup (`ray_address_to_api_server_url`) reads the key and namespace we read."""
    from ray.dashboard import utils as dashboard_utils

    constants = ray._private.ray_constants
    assert isinstance(constants.DASHBOARD_ADDRESS, str) and isinstance(constants.KV_NAMESPACE_DASHBOARD, bytes)
    source = inspect.getsource(dashboard_utils.ray_address_to_api_server_url)
    assert "ray_constants.DASHBOARD_ADDRESS" in source and "ray_constants.KV_NAMESPACE_DASHBOARD" in source


def test_an_actor_handles_actor_id_is_a_property_giving_an_actor_id():
    getter = vars(ray.actor.ActorHandle)["_actor_id"]
    assert isinstance(getter, property)
    actor_id = ray.ActorID.from_random()
    assert getter.fget(SimpleNamespace(_ray_actor_id=actor_id)).hex() == actor_id.hex()


def test_the_global_node_is_a_module_attribute_of_rays_worker_and_names_the_logs_directory():
    assert hasattr(ray._private.worker, "_global_node"), "session_log would fall back to logging to stderr"
    takes(ray._private.node.Node.get_logs_dir_path, object())


def test_the_global_workers_mode_compares_with_rays_worker_mode():
    assert hasattr(ray._private.worker.global_worker, "mode")
    assert ray.WORKER_MODE != ray.SCRIPT_MODE


def test_the_core_workers_job_config_carries_the_drivers_sys_path():
    assert isinstance(ray._private.worker.global_worker, ray._private.worker.Worker)
    assert callable(ray._raylet.CoreWorker.get_job_config)
    from ray.core.generated.common_pb2 import JobConfig

    assert "py_driver_sys_path" in JobConfig.DESCRIPTOR.fields_by_name


def test_the_stdstream_dispatcher_swaps_handlers_by_name_and_ray_init_installs_ray_print_logs():
    dispatcher = ray._private.ray_logging.global_worker_stdstream_dispatcher
    assert isinstance(dispatcher.handlers, list)
    takes(dispatcher.add_handler, "ray_elastic_script_lines", print)
    takes(dispatcher.remove_handler, "ray_print_logs")
    assert '"ray_print_logs"' in inspect.getsource(ray._private.worker), "the handler cli.py replaces"


def test_the_stdout_and_stderr_deduplicators_have_a_skip_pattern():
    for dedup in (ray._private.ray_logging.stdout_deduplicator, ray._private.ray_logging.stderr_deduplicator):
        assert hasattr(dedup, "skip_re")


# ---- each function of ours reaches the name it is named for, with the arguments it was given ----------------------


def test_the_kv_functions_pass_their_arguments_to_rays_internal_kv(monkeypatch):
    calls = []
    for name in ("put", "get", "del", "exists", "list"):
        monkeypatch.setattr(
            internal_kv, f"_internal_kv_{name}", lambda *a, _name=name, **k: calls.append((_name, a, k)) or _name
        )
    assert ray_private.kv_put(b"k", b"v", overwrite=False, namespace="ns") == "put"
    assert ray_private.kv_get(b"k", namespace="ns") == "get"
    assert ray_private.kv_del("k", namespace="ns") == "del"
    assert ray_private.kv_exists("k", namespace="ns") == "exists"
    assert ray_private.kv_list("p", namespace="ns") == "list"
    assert calls == [
        ("put", (b"k", b"v", False), {"namespace": "ns"}),
        ("get", (b"k",), {"namespace": "ns"}),
        ("del", ("k",), {"namespace": "ns"}),
        ("exists", ("k",), {"namespace": "ns"}),
        ("list", ("p",), {"namespace": "ns"}),
    ]


def test_the_actor_and_node_functions_read_rays_state(monkeypatch):
    records = {"a1": {"State": "DEAD", "NumRestarts": 1}}
    monkeypatch.setattr(ray._private.state, "actors", lambda actor_id: records.get(actor_id, {}))
    monkeypatch.setattr(ray._private.state.state, "get_draining_nodes", lambda: {"n1": 5000})
    monkeypatch.setattr(ray._private.state, "available_resources_per_node", lambda: {"n1": {"CPU": 2.0}})
    assert ray_private.actor_record("a1") == records["a1"]
    assert ray_private.actor_state("a1") == "DEAD"
    assert ray_private.actor_state("unknown") is None
    assert ray_private.draining_nodes() == {"n1": 5000}
    assert ray_private.available_resources_per_node() == {"n1": {"CPU": 2.0}}
    actor_id = ray.ActorID.from_random()
    assert ray_private.actor_id_of(SimpleNamespace(_actor_id=actor_id)) == actor_id.hex()


def test_the_dashboard_url_is_read_from_the_connected_clusters_kv(monkeypatch):
    constants = ray._private.ray_constants
    kv = {(constants.DASHBOARD_ADDRESS, constants.KV_NAMESPACE_DASHBOARD): b"10.0.0.5:8265"}
    monkeypatch.setattr(internal_kv, "_internal_kv_get", lambda key, namespace=None: kv.get((key, namespace)))
    assert ray_private.dashboard_url() == "http://10.0.0.5:8265"
    kv.clear()  # a cluster started without its dashboard
    assert ray_private.dashboard_url() is None


def test_the_worker_functions_read_this_processs_ray_worker(monkeypatch):
    node, job = object(), object()
    monkeypatch.setattr(ray._private.worker, "_global_node", node)
    monkeypatch.setattr(ray._private.worker.global_worker, "mode", ray.WORKER_MODE)
    monkeypatch.setattr(
        ray._private.worker.global_worker, "core_worker", SimpleNamespace(get_job_config=lambda: job), raising=False
    )
    assert ray_private.global_node() is node
    assert ray_private.worker_mode() == ray.WORKER_MODE
    assert ray_private.job_config() is job
    assert ray_private.stdstream_dispatcher() is ray._private.ray_logging.global_worker_stdstream_dispatcher
    assert ray_private.output_deduplicators() == (
        ray._private.ray_logging.stdout_deduplicator,
        ray._private.ray_logging.stderr_deduplicator,
    )


def test_importing_the_fence_imports_no_ray():
    """The CLI and a worker's start import it: Ray's modules load only when a function is called."""
    tree = ast.parse(pathlib.Path(ray_private.__file__).read_text())
    top = [node for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)]
    assert all(not _names_ray(node) for node in top)


def _names_ray(node: ast.Import | ast.ImportFrom) -> bool:
    if isinstance(node, ast.ImportFrom):
        return (node.module or "").split(".")[0] == "ray"
    return any(alias.name.split(".")[0] == "ray" for alias in node.names)


# ---- the fence holds: no other module of ray_elastic uses a private name of Ray ------------------------------------

# private attributes of Ray objects that a scan cannot tell from ours by their owner: named here once they are used
RAY_PRIVATE_ATTRIBUTES = frozenset(
    {"_actor_id", "_ray_actor_id", "_global_node", "_datasets_to_split", "_get_user_execution_options"}
)

# uses outside the fence that are known and checked elsewhere; an entry that is no longer found must go too
ALLOWED = {
    # Ray Data's names, imported where they are used: RAY_NAMES, each imported by tests/unit/test_data_batches.py
    "data/batches.py": {
        "ray.data.block._apply_batch_format",
        "ray.data.collate_fn._PinMemoryCollateFnWrapper",
    },
    # ray.train.DataConfig's private fields, checked by tests/unit/test_ray_train_surface.py (to move into the fence)
}


def private_ray_names(source: str) -> set[str]:
    """The private names of Ray `source` uses: a dotted `ray.` path with an underscored part (as code, import or
    string), or an attribute in `RAY_PRIVATE_ATTRIBUTES`."""
    tree = ast.parse(source)
    bound = {"ray": "ray"}  # a local name -> the Ray path it stands for (`from ray.experimental import internal_kv`)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ray":
            bound |= {a.asname or a.name: f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            bound |= {a.asname: a.name for a in node.names if a.asname and a.name.split(".")[0] == "ray"}
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ray":
            found |= {f"{node.module}.{a.name}" for a in node.names if _private(f"{node.module}.{a.name}")}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "ray" and _private(a.name)}
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node, bound)
            if dotted is not None and _private(dotted):
                found.add(dotted)
            elif node.attr in RAY_PRIVATE_ATTRIBUTES:
                found.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value.strip("`")
            if text in RAY_PRIVATE_ATTRIBUTES or (text.startswith("ray.") and _private(text) and " " not in text):
                found.add(text)
    # `ray._private.state.actors` is found once, not also as its prefixes `ray._private.state`, `ray._private`
    return {name for name in found if not any(other.startswith(name + ".") for other in found)}


def _private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))


def _dotted(node: ast.AST, bound: dict[str, str]) -> str | None:
    """`a.b.c` as the Ray path it names (its first name resolved through `bound`), None if it is not Ray's."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in bound:
        return None
    return ".".join([bound[node.id], *reversed(parts)])


def test_the_scan_finds_each_kind_of_private_use():
    source = """
import ray
import ray._private.state
from ray.experimental.internal_kv import _internal_kv_get
from ray.experimental import internal_kv
import ray.util.state as rus
internal_kv._internal_kv_put(b"k", b"v")
rus._private_helper()
from ray._private.ray_logging import stdout_deduplicator
ray._private.state.actors(handle._actor_id.hex())
getattr(ray._private.worker, "_global_node", None)
NAMES = ("ray.data.block._apply_batch_format", "ray.data.block.BlockAccessor")
ray.get_runtime_context().get_actor_id()
"""
    assert private_ray_names("import ray._private.state") == {"ray._private.state"}
    assert private_ray_names(source) == {
        "ray.experimental.internal_kv._internal_kv_get",
        "ray.experimental.internal_kv._internal_kv_put",
        "ray.util.state._private_helper",
        "ray._private.ray_logging.stdout_deduplicator",
        "ray._private.state.actors",
        "_actor_id",
        "ray._private.worker",
        "_global_node",
        "ray.data.block._apply_batch_format",
    }


def test_no_module_but_ray_private_uses_a_private_name_of_ray():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative != "ray_private.py" and (names := private_ray_names(path.read_text())):
            found[relative] = names
    outside = {path: names - ALLOWED.get(path, set()) for path, names in found.items()}
    assert not {path: names for path, names in outside.items() if names}, (
        "call Ray's private names through ray_elastic/ray_private.py (a function there, tested in this file)"
    )
    stale = {path: names - found.get(path, set()) for path, names in ALLOWED.items()}
    assert not {path: names for path, names in stale.items() if names}, "no longer used there: drop from ALLOWED"


@pytest.mark.parametrize(
    "name", [n for n, f in vars(ray_private).items() if inspect.isfunction(f) and f.__module__ == ray_private.__name__]
)
def test_each_function_of_the_fence_says_what_it_reads(name):
    assert (getattr(ray_private, name).__doc__ or "").strip()


def test_data_configs_private_arguments_are_where_we_read_them():
    from ray.data import ExecutionOptions
    from ray.train import DataConfig

    options = ExecutionOptions(preserve_order=True)
    config = DataConfig(datasets_to_split=["train"], execution_options={"train": options})
    assert ray_private.datasets_to_split(config) == ["train"]
    assert ray_private.execution_options_of(config, "train") is not None
    assert ray_private.datasets_to_split(DataConfig()) == "all"
