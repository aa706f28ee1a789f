"""horovod.ray's executors on ray-elastic, without Ray: how `RayExecutor`'s and `ElasticRayExecutor`'s
arguments map, and that bad input fails before anything is spawned, naming the argument. The runs are in
integration/test_horovod_ray_cluster.py.
"""

from __future__ import annotations

import os

import pytest

import ray_elastic.horovod.ray as hray
from ray_elastic.horovod.ray import ElasticRayExecutor, RayExecutor, TestDiscovery
from ray_elastic.horovod.ray.sessions import Callbacks
from ray_elastic.horovod.ray.settings import HorovodRayWarning
from ray_elastic.horovod.ray.worker_loop import MARK
from ray_elastic.trainer.driver_watch import Reports


def test_create_settings_keeps_horovods_fields_and_maps_nics_to_one_interface():
    st = RayExecutor.create_settings(timeout_s=5, placement_group_timeout_s=7, nics={"eth1"})
    assert (st.timeout_s, st.placement_group_timeout_s, st.nics, st.verbose) == (5, 7, {"eth1"}, 1)
    with pytest.raises(ValueError, match="nics=.*one interface"):
        RayExecutor.create_settings(nics={"eth0", "eth1"})
    with pytest.raises(ValueError, match="timeout_s"):
        RayExecutor.create_settings(timeout_s=0)


def test_ssh_arguments_warn_naming_themselves_and_write_no_key(tmp_path):
    key = tmp_path / "key"
    with pytest.warns(HorovodRayWarning, match="ssh_identity_file.*ssh_str"):
        RayExecutor.create_settings(ssh_identity_file=str(key), ssh_str="PRIVATE")
    assert not key.exists()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_workers": 4}, "max_workers was given without a positive min_workers"),
        ({"min_workers": 1, "num_workers": 2}, "both min_workers and num_workers"),
        ({}, "pass num_workers"),
        ({"num_workers": 2, "num_hosts": 2}, "not both"),
        ({"num_workers": 0}, "num_workers must be an integer >= 1"),
        ({"num_workers": 2, "gpus_per_worker": 1}, "gpus_per_worker is set, but use_gpu is False"),
        ({"min_workers": 2, "max_workers": 1}, r"max_workers \(1\) must be >= min_workers \(2\)"),
        ({"min_workers": 1, "cooldown_range": (5, 1)}, "cooldown_range"),
        ({"min_workers": 1, "override_discovery": False}, "override_discovery=False needs settings.discovery"),
    ],
)
def test_bad_executor_arguments_fail_before_anything_starts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RayExecutor(RayExecutor.create_settings(), **kwargs)


def test_static_and_elastic_modes_and_what_each_ignores_says_so():
    st = RayExecutor.create_settings()
    assert RayExecutor(st, num_hosts=2, num_workers_per_host=2).plan.num_workers == 4
    assert st.elastic is False
    assert RayExecutor(st, min_workers=1, max_workers=3).elastic and st.elastic
    with pytest.warns(HorovodRayWarning, match="reset_limit, cooldown_range ignored: a static run"):
        RayExecutor(st, num_workers=2, reset_limit=1, cooldown_range=(1, 2))
    with pytest.warns(HorovodRayWarning, match="num_hosts ignored: elastic mode"):
        RayExecutor(st, min_workers=1, num_hosts=2)


def test_calls_before_start_and_elastic_only_refusals_name_the_method():
    static = RayExecutor(RayExecutor.create_settings(), num_workers=2)
    with pytest.raises(RuntimeError, match="call start"):
        static.run(lambda: 1)
    elastic = RayExecutor(RayExecutor.create_settings(), min_workers=1)
    with pytest.raises(NotImplementedError, match="execute_single"):
        elastic.execute_single(lambda w: 1)
    with pytest.raises(NotImplementedError, match="run_remote"):
        elastic.run_remote(lambda: 1)
    static.shutdown()  # before start: nothing to do


def test_elastic_ray_executor_settings_as_horovod_names_them():
    with pytest.warns(DeprecationWarning, match="min_np is deprecated"):
        st = ElasticRayExecutor.create_settings(min_np=2, max_num_proc=4, cooldown_range=(1, 2), verbose=2)
    assert (st.min_num_proc, st.num_proc, st.max_num_proc, st.cooldown_range, st.verbose) == (2, 2, 4, (1, 2), 2)
    with pytest.raises(TypeError, match=r"\['cpus_per_slot'\]"):
        ElasticRayExecutor.create_settings(cpus_per_slot=2)
    with pytest.warns(HorovodRayWarning, match="ssh_port"):
        ElasticRayExecutor.create_settings(ssh_port=22)
    with pytest.raises(ValueError, match="max_num_proc"):
        ElasticRayExecutor.create_settings(min_num_proc=3, max_num_proc=2)
    with pytest.raises(ValueError, match="override_discovery=False needs settings.discovery"):
        ElasticRayExecutor(ElasticRayExecutor.create_settings(), override_discovery=False)
    ex = ElasticRayExecutor(st, cpus_per_slot=2)
    assert isinstance(st.discovery, hray.RayHostDiscovery) and ex.resources == {"CPU": 2.0}


def test_test_discovery_withdraws_then_gives_back_a_host_on_schedule(monkeypatch):
    nodes = {"a": 2, "b": 2}
    monkeypatch.setattr(hray.RayHostDiscovery, "find_available_hosts_and_slots", lambda self: dict(nodes))
    now = [100.0]
    monkeypatch.setattr("ray_elastic.horovod.ray.elastic.time.time", lambda: now[0])
    d = TestDiscovery(min_hosts=1, max_hosts=2, change_frequency_s=10, verbose=False, seed=0)
    seen = []
    for _ in range(4):
        seen.append(len(d.find_available_hosts_and_slots()))
        now[0] += 10
    assert seen == [2, 1, 2, 1]
    with pytest.raises(ValueError, match="_graceful=False"):
        TestDiscovery(1, 2, 10, _graceful=False)


def test_callbacks_get_rank0_reports_once_and_never_the_command_markers():
    got = []
    calls = Callbacks()
    calls.begin([got.append])
    forwarding = Reports(None, calls)  # fit(on_report=calls)'s own path
    forwarding.take(0, [(0.0, {"loss": 1.0}), (0.1, {MARK: 0})])
    forwarding.take(0, [(0.0, {"loss": 1.0}), (0.1, {MARK: 0}), (0.2, {"loss": 0.5})])  # fit() re-fetches
    assert got == [{"loss": 1.0}, {"loss": 0.5}] and calls.wait_marked(0, 0)

    def broken(info):
        raise KeyError("callback bug")

    calls.begin([broken])
    calls({"loss": 2.0})
    assert isinstance(calls.end(), KeyError)
    with pytest.raises(ValueError, match="callbacks must be callables"):
        calls.begin([3])


def test_num_hosts_places_exactly_num_workers_per_host_on_each_node_and_skips_smaller_nodes(monkeypatch):
    from ray_elastic.assignment import plan_scaling
    from ray_elastic.horovod.ray import runner

    cluster_slots = {"old": 4, "small": 1, "mid": 2, "young": 3}
    monkeypatch.setattr(runner.RayClusterDiscovery, "__call__", lambda self: dict(cluster_slots))
    executor = RayExecutor(RayExecutor.create_settings(), num_hosts=2, num_workers_per_host=2)
    hosts = runner._ExactlyPerHost(executor.plan.per_host, executor.resources)()
    assert hosts == {"old": 2, "mid": 2, "young": 2}  # "small" cannot hold 2; "old" offers 2 of its 4
    first_seen = {"old": 1.0, "small": 2.0, "mid": 3.0, "young": 4.0}
    plan = plan_scaling([], hosts, first_seen, (), executor.plan.num_workers)
    assert plan.add == {"old": 2, "mid": 2}  # 2 nodes x 2 workers, none split 3 + 1


def test_horovod_ray_names_with_no_counterpart_warn_or_raise_naming_themselves(monkeypatch):
    import queue

    settings = RayExecutor.create_settings()
    with pytest.raises(AttributeError, match="start_timeout.*timeout_s and placement_group_timeout_s"):
        settings.start_timeout  # noqa: B018 - reading it is the point
    settings.key, settings.ssh_port = "secret", 22
    with pytest.warns(HorovodRayWarning, match=r"ssh_port \(.*\); key \("):
        RayExecutor(settings, num_workers=2)
    # horovod.ray's worker logging hook: dicts go to the queue it was given, as there
    q = queue.Queue()
    monkeypatch.setattr(os, "environ", dict(os.environ))  # a worker sets HOROVOD_RANK... in its own process
    hray.BaseHorovodWorker().set_queue(q)
    try:
        hray.ray_logger.log({"loss": 1.0})
        assert q.get_nowait() == {"loss": 1.0}
    finally:
        hray.ray_logger.configure(None)
    with pytest.raises(ValueError, match="queue with put"):
        hray.ray_logger.configure(3)
    # elastic_v2's discoveries, with its cpus_per_worker spelling
    from ray_elastic.horovod.ray.elastic_v2 import RayHostDiscovery as V2Discovery
    from ray_elastic.horovod.ray.elastic_v2 import TestDiscovery as V2TestDiscovery

    assert V2Discovery(use_gpu=True, cpus_per_worker=2, gpus_per_worker=1).per_worker == {"CPU": 2.0, "GPU": 1.0}
    assert V2TestDiscovery(1, 2, 5, cpus_per_worker=3).per_worker == {"CPU": 3.0}
    from ray_elastic.horovod.ray.runner import MiniSettings

    assert isinstance(settings, MiniSettings)


SAMPLES, LR = 512, 0.01


BASIC_SAMPLES, BASIC_EPOCHS, BASIC_LR = 512, 12, 0.01
