"""Unit tests for `ray_elastic.discovery`: parsing, IP resolution, the three sources, the poller.

No Ray: every source takes a `nodes=` callable, fed here with fake node lists.
Scripts are real tiny executables written to `tmp_path`.
"""

from __future__ import annotations

import logging
import os
import pathlib
import time
from pathlib import Path

import pytest
from conftest import wait_until
from hypothesis import given
from hypothesis import strategies as st

from ray_elastic.discovery import (
    CallableDiscovery,
    DiscoveryError,
    DiscoveryPoller,
    KeepCpusFree,
    NodeInfo,
    RayClusterDiscovery,
    ScriptDiscovery,
    check_discovery_spec,
    keep_cpus_free,
    make_discovery,
    parse_host_lines,
    resolve_hosts,
    slots_for_resources,
    validate_host_slots,
)

CPU1 = {"CPU": 1.0}

NODES = [
    NodeInfo(node_id="node-a", ip="10.0.0.1", resources={"CPU": 4.0}),
    NodeInfo(node_id="node-b", ip="10.0.0.2", resources={"CPU": 2.0, "GPU": 1.0}),
    # two local test nodes that share one IP
    NodeInfo(node_id="node-c", ip="127.0.0.1", resources={"CPU": 2.0}),
    NodeInfo(node_id="node-d", ip="127.0.0.1", resources={"CPU": 2.0}),
]


def write_script(directory: pathlib.Path, body: str, name: str = "discover.sh") -> pathlib.Path:
    path = directory / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class FlakySource:
    """A discovery source whose next answer the test sets: a dict, or an exception to raise."""

    def __init__(self) -> None:
        self.next: dict[str, int] | Exception = {}

    def __call__(self) -> dict[str, int]:
        if isinstance(self.next, Exception):
            raise self.next
        return dict(self.next)

    def __repr__(self) -> str:
        return "flaky-source"


# ---- slots_for_resources ---------------------------------------------------------


def test_slots_for_resources_is_bounded_by_the_scarcest_resource():
    node = {"CPU": 16.0, "GPU": 2.0, "memory": 1e12}
    assert slots_for_resources(node, {"CPU": 4}) == 4
    assert slots_for_resources(node, {"CPU": 4, "GPU": 1}) == 2
    assert slots_for_resources(node, {"CPU": 3}) == 5  # floor


def test_slots_for_resources_missing_resource_gives_no_slots():
    assert slots_for_resources({"CPU": 8.0}, {"CPU": 1, "GPU": 1}) == 0


def test_slots_for_resources_ignores_zero_amounts():
    assert slots_for_resources({"CPU": 8.0}, {"CPU": 2, "GPU": 0}) == 4


def test_slots_for_resources_tolerates_fractional_rounding():
    # 0.1 * 3 != 0.3 in floating point; the node still holds three 0.1-CPU workers
    assert slots_for_resources({"CPU": 0.1 * 3}, {"CPU": 0.1}) == 3
    assert slots_for_resources({"CPU": 0.3}, {"CPU": 0.1}) == 3


@given(st.sampled_from([0.1, 0.2, 0.25, 0.3, 0.5, 1.0, 1.5, 2.0, 4.0]), st.integers(0, 64))
def test_slots_for_resources_counts_exact_multiples(amount: float, k: int):
    assert slots_for_resources({"CPU": amount * k}, {"CPU": amount}) == k
    assert slots_for_resources({"CPU": amount * k + amount / 2}, {"CPU": amount}) == k


# ---- parse_host_lines ------------------------------------------------------------


def test_parse_host_lines_reads_horovod_format():
    text = """
    # inventory of the cluster
    node-a:4
    node-b        # bare host: default slots

    10.0.0.7:2    # an IP
    node-c:0
    """
    assert parse_host_lines(text, default_slots=3) == {"node-a": 4, "node-b": 3, "10.0.0.7": 2, "node-c": 0}


def test_parse_host_lines_bare_hosts_get_one_slot_by_default():
    assert parse_host_lines("a\nb\n") == {"a": 1, "b": 1}


def test_parse_host_lines_empty_output_is_no_hosts():
    assert parse_host_lines("") == {}
    assert parse_host_lines("\n  \n# nothing yet\n") == {}


@pytest.mark.parametrize(
    ("text", "bad_line", "lineno"),
    [
        ("a:2\nb:x\n", "b:x", 2),
        ("a:2\nb:\n", "b:", 2),
        ("a:-1\n", "a:-1", 1),
        ("ok:1\n\n:3\n", ":3", 3),
        ("two words:1\n", "two words:1", 1),
        ("hello world\n", "hello world", 1),
        ("a:1.5\n", "a:1.5", 1),
    ],
)
def test_parse_host_lines_malformed_line_raises_naming_it(text: str, bad_line: str, lineno: int):
    with pytest.raises(DiscoveryError) as info:
        parse_host_lines(text)
    assert bad_line in str(info.value)
    assert f"line {lineno}" in str(info.value)


host_names = st.from_regex(r"[a-z0-9][a-z0-9.\-]{0,20}", fullmatch=True)


@given(st.dictionaries(host_names, st.integers(0, 64), max_size=10), st.booleans())
def test_parse_host_lines_round_trips(hosts: dict[str, int], with_noise: bool):
    lines = []
    for host, slots in hosts.items():
        if with_noise:
            lines += ["", "# a comment", f"  {host}:{slots}   # trailing comment"]
        else:
            lines.append(f"{host}:{slots}")
    assert parse_host_lines("\n".join(lines)) == hosts


# ---- validate_host_slots -----------------------------------------------------------


def test_validate_host_slots_accepts_str_to_nonnegative_int():
    assert validate_host_slots({"a": 2, "b": 0}, "src") == {"a": 2, "b": 0}


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (["a", "b"], "dict"),
        (None, "dict"),
        ({"": 1}, "non-empty string"),
        ({3: 1}, "non-empty string"),
        ({"a": -1}, "int >= 0"),
        ({"a": 1.5}, "int >= 0"),
        ({"a": "2"}, "int >= 0"),
        ({"a": True}, "int >= 0"),
    ],
)
def test_validate_host_slots_rejects_bad_values_naming_the_source(value, fragment):
    with pytest.raises(DiscoveryError) as info:
        validate_host_slots(value, "my-source")
    assert "my-source" in str(info.value)
    assert fragment in str(info.value)


# ---- resolve_hosts -----------------------------------------------------------------


def test_resolve_hosts_keeps_node_ids():
    assert resolve_hosts({"node-a": 2, "node-b": 1}, NODES, CPU1) == {"node-a": 2, "node-b": 1}


def test_resolve_hosts_maps_a_unique_ip_to_its_node_id():
    assert resolve_hosts({"10.0.0.1": 3}, NODES, CPU1) == {"node-a": 3}


def test_resolve_hosts_rejects_an_ip_shared_by_several_nodes():
    with pytest.raises(DiscoveryError) as info:
        resolve_hosts({"127.0.0.1": 1}, NODES, CPU1)
    assert "127.0.0.1" in str(info.value)
    assert "node ID" in str(info.value)


def test_resolve_hosts_skips_hosts_ray_does_not_know():
    assert resolve_hosts({"10.9.9.9": 4, "node-zzz": 1, "node-a": 1}, NODES, CPU1) == {"node-a": 1}


def test_resolve_hosts_maps_a_hostname_to_the_node_with_its_address():
    """Horovod discovery scripts print hostnames; one resolving to a node's IP names that node."""
    nodes = [NodeInfo(node_id="node-local", ip="127.0.0.1", resources={"CPU": 2.0})]
    unknown: list[str] = []
    assert resolve_hosts({"localhost": 2, "no-such-host.invalid": 1}, nodes, CPU1, unknown) == {"node-local": 2}
    assert unknown == ["no-such-host.invalid"]


def test_hosts_that_are_not_ray_nodes_are_named_in_a_warning_at_once_and_once(caplog):
    nodes = [NodeInfo(node_id="node-a", ip="10.0.0.1", resources={"CPU": 2.0})]
    source = CallableDiscovery(lambda: {"worker-7.invalid": 2, "node-a": 2}, CPU1, nodes=lambda: nodes)
    with caplog.at_level("WARNING", logger="ray_elastic.discovery"):
        assert source() == {"node-a": 2}
        assert source() == {"node-a": 2}
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert "worker-7.invalid" in warnings[0] and "node-a" in warnings[0] and "10.0.0.1" in warnings[0]


def test_resolve_hosts_caps_slots_at_node_capacity():
    assert resolve_hosts({"node-a": 100, "10.0.0.2": 5}, NODES, CPU1) == {"node-a": 4, "node-b": 2}
    assert resolve_hosts({"node-b": 5}, NODES, {"CPU": 1, "GPU": 1}) == {"node-b": 1}


def test_resolve_hosts_caps_a_node_named_both_by_id_and_by_ip():
    # node-a holds 4 one-CPU workers; naming it twice must not ask for 6 placement groups that never fit
    resolved = resolve_hosts({"node-a": 3, "10.0.0.1": 3}, NODES, CPU1)
    assert resolved == {"node-a": 4}


# ---- RayClusterDiscovery / CallableDiscovery -----------------------------------------


def test_ray_cluster_discovery_offers_every_node_that_fits_a_worker():
    disc = RayClusterDiscovery({"CPU": 2}, nodes=lambda: NODES)
    assert disc() == {"node-a": 2, "node-b": 1, "node-c": 1, "node-d": 1}
    gpu = RayClusterDiscovery({"CPU": 1, "GPU": 1}, nodes=lambda: NODES)
    assert gpu() == {"node-b": 1}  # nodes without a GPU are not offered at all


def test_ray_cluster_discovery_sees_nodes_join_and_leave():
    nodes = [NODES[0]]
    disc = RayClusterDiscovery(CPU1, nodes=lambda: list(nodes))
    assert disc() == {"node-a": 4}
    nodes.append(NODES[1])
    assert disc() == {"node-a": 4, "node-b": 2}
    nodes.pop(0)
    assert disc() == {"node-b": 2}


# ---- CPUs kept for Ray Data ------------------------------------------------------------

TWO_BY_TWO = [  # the shape that starved a dataset: a head without CPUs, two nodes of 2 CPUs
    NodeInfo(node_id="head", ip="10.0.0.9", resources={"CPU": 0.0}),
    NodeInfo(node_id="node-a", ip="10.0.0.1", resources={"CPU": 2.0}),
    NodeInfo(node_id="node-b", ip="10.0.0.2", resources={"CPU": 2.0}),
]


def test_keeping_a_cpu_for_ray_data_takes_one_slot_when_workers_would_fill_the_cluster():
    hosts = {"node-a": 2, "node-b": 2}
    kept = keep_cpus_free(hosts, TWO_BY_TWO, worker_cpus=1.0, keep=1)
    assert sum(kept.values()) == 3
    assert sum(keep_cpus_free(hosts, TWO_BY_TWO, worker_cpus=1.0, keep=2).values()) == 2
    assert keep_cpus_free(hosts, TWO_BY_TWO, worker_cpus=1.0, keep=0) == hosts


def test_cpus_no_worker_can_take_already_count_as_kept():
    nodes = [NodeInfo(node_id="n", ip="10.0.0.1", resources={"CPU": 3.0})]
    assert keep_cpus_free({"n": 1}, nodes, worker_cpus=2.0, keep=1) == {"n": 1}  # the third CPU is free anyway
    head = [*TWO_BY_TWO[1:], NodeInfo(node_id="head", ip="10.0.0.9", resources={"CPU": 1.0})]
    assert keep_cpus_free({"node-a": 2, "node-b": 2}, head, worker_cpus=1.0, keep=1) == {"node-a": 2, "node-b": 2}


def test_a_kept_cpu_is_a_whole_cpu_on_one_node():
    """Two halves on two nodes do not run a one-CPU task: a slot goes until one node has a whole CPU free."""
    kept = keep_cpus_free({"node-a": 2, "node-b": 2}, TWO_BY_TWO, worker_cpus=0.75, keep=1)
    assert sorted(kept.values()) == [1, 2]


def test_the_kept_cpu_stays_on_the_same_node_when_a_node_joins(caplog):
    """Moving it would evict a worker from a full node for nothing."""
    nodes = list(TWO_BY_TWO)
    source = RayClusterDiscovery(CPU1, nodes=lambda: list(nodes))
    disc = KeepCpusFree(source, 1, CPU1, nodes=lambda: list(nodes))
    with caplog.at_level(logging.INFO, logger="ray_elastic.discovery"):
        first = disc()
    assert sum(first.values()) == 3
    assert "keeping 1 CPU(s) free for Ray Data's tasks (data_cpus=1): 3 worker slot(s) of 4" in caplog.text
    trimmed = next(h for h, s in first.items() if s == 1)
    for name in ("node-0", "node-z"):  # one sorting before every node, one after
        nodes.append(NodeInfo(node_id=name, ip=f"10.0.1.{len(nodes)}", resources={"CPU": 2.0}))
        assert disc()[trimmed] == 1 and sum(disc().values()) == 2 * (len(nodes) - 1) - 1
    assert repr(disc) == "the Ray cluster"


def test_callable_discovery_validates_and_resolves():
    disc = CallableDiscovery(lambda: {"10.0.0.1": 2, "node-b": 9, "10.9.9.9": 1}, CPU1, nodes=lambda: NODES)
    assert disc() == {"node-a": 2, "node-b": 2}


def test_callable_discovery_picks_up_a_host_once_it_joins_ray():
    nodes = [NODES[0]]
    disc = CallableDiscovery(lambda: {"node-a": 1, "10.0.0.2": 1}, CPU1, nodes=lambda: list(nodes))
    assert disc() == {"node-a": 1}
    nodes.append(NODES[1])
    assert disc() == {"node-a": 1, "node-b": 1}


def test_callable_discovery_rejects_bad_return_naming_the_function():
    def my_inventory():
        return [("node-a", 1)]

    disc = CallableDiscovery(my_inventory, CPU1, nodes=lambda: NODES)
    with pytest.raises(DiscoveryError, match="my_inventory"):
        disc()


# ---- ScriptDiscovery -----------------------------------------------------------------


def test_script_discovery_parses_and_resolves_script_output(tmp_path):
    script = write_script(
        tmp_path,
        'echo "# produced by the inventory"\necho "node-a:2"\necho "10.0.0.2"\necho "10.9.9.9:8"\n',
    )
    disc = ScriptDiscovery(str(script), CPU1, default_slots=2, nodes=lambda: NODES)
    assert disc() == {"node-a": 2, "node-b": 2}


def test_script_discovery_nonzero_exit_reports_code_and_stderr(tmp_path):
    script = write_script(tmp_path, 'echo "node-a:1"\necho "inventory service unreachable" >&2\nexit 3\n')
    disc = ScriptDiscovery(str(script), CPU1, nodes=lambda: NODES)
    with pytest.raises(DiscoveryError) as info:
        disc()
    message = str(info.value)
    assert "exited with 3" in message
    assert "inventory service unreachable" in message
    assert str(script) in message


def test_script_discovery_garbage_output_names_the_line(tmp_path):
    script = write_script(tmp_path, 'echo "node-a:1"\necho "Traceback (most recent call last):"\n')
    disc = ScriptDiscovery(str(script), CPU1, nodes=lambda: NODES)
    with pytest.raises(DiscoveryError) as info:
        disc()
    assert "line 2" in str(info.value)
    assert "Traceback (most recent call last):" in str(info.value)


def test_script_discovery_missing_script_is_a_discovery_error(tmp_path):
    disc = ScriptDiscovery(str(tmp_path / "nope.sh"), CPU1, nodes=lambda: NODES)
    with pytest.raises(DiscoveryError, match="could not run"):
        disc()


def test_script_discovery_hanging_script_times_out(tmp_path):
    script = write_script(tmp_path, "exec sleep 60\n")
    disc = ScriptDiscovery(str(script), CPU1, timeout=0.2, nodes=lambda: NODES)
    start = time.monotonic()
    with pytest.raises(DiscoveryError) as info:
        disc()
    assert time.monotonic() - start < 10
    assert "did not finish within 0.2 s" in str(info.value)
    assert str(script) in str(info.value)


def test_script_discovery_timeout_kills_what_the_script_started(tmp_path):
    pidfile = tmp_path / "child.pid"
    script = write_script(tmp_path, f"sleep 60 &\necho $! > {pidfile}\nwait\n")
    disc = ScriptDiscovery(str(script), CPU1, timeout=0.5, nodes=lambda: NODES)
    with pytest.raises(DiscoveryError, match="did not finish within 0.5 s"):
        disc()
    child = int(pidfile.read_text())

    def gone() -> bool:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return True
        # a killed process may linger as a zombie until it is reaped: that is gone too
        try:
            return Path(f"/proc/{child}/stat").read_text().split()[2] == "Z"
        except FileNotFoundError:
            return True

    wait_until(gone, 10, f"the script's child process {child} to be killed")


def test_script_discovery_sees_the_script_change_its_answer(tmp_path):
    state = tmp_path / "hosts.txt"
    state.write_text("node-a:1\n")
    script = write_script(tmp_path, f'cat "{state}"\n')
    disc = ScriptDiscovery(str(script), CPU1, nodes=lambda: NODES)
    assert disc() == {"node-a": 1}
    state.write_text("node-a:2\nnode-b:1\n")
    assert disc() == {"node-a": 2, "node-b": 1}


def test_script_given_by_a_relative_name_in_the_working_directory_runs(tmp_path, monkeypatch):
    # `discovery="discover.sh"` passes check_discovery_spec (the file exists in the cwd), so it must also run
    write_script(tmp_path, 'echo "node-a:1"\n')
    monkeypatch.chdir(tmp_path)
    check_discovery_spec("discover.sh")
    disc = ScriptDiscovery("discover.sh", CPU1, nodes=lambda: NODES)
    assert disc() == {"node-a": 1}


# ---- check_discovery_spec / make_discovery ------------------------------------------


def test_check_discovery_spec_accepts_none_callables_and_executable_scripts(tmp_path):
    script = write_script(tmp_path, 'echo "node-a:1"\n')
    check_discovery_spec(None)
    check_discovery_spec(lambda: {"node-a": 1})
    check_discovery_spec(str(script))
    check_discovery_spec(script)  # os.PathLike


def test_check_discovery_spec_rejects_a_missing_script(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        check_discovery_spec(str(tmp_path / "missing.sh"))


def test_check_discovery_spec_rejects_a_non_executable_script(tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho node-a:1\n")
    script.chmod(0o644)
    with pytest.raises(ValueError, match="chmod"):
        check_discovery_spec(str(script))


@pytest.mark.parametrize("spec", [42, {"node-a": 1}, ["node-a"]])
def test_check_discovery_spec_rejects_other_types(spec):
    with pytest.raises(ValueError, match="discovery must be"):
        check_discovery_spec(spec)


def test_make_discovery_picks_the_source_by_spec(tmp_path):
    script = write_script(tmp_path, 'echo "node-a:1"\n')

    def fn():
        return {"node-a": 1}

    assert isinstance(make_discovery(None, CPU1), RayClusterDiscovery)
    by_path = make_discovery(script, CPU1)
    assert isinstance(by_path, ScriptDiscovery) and by_path.path == str(script)
    by_fn = make_discovery(fn, CPU1)
    assert isinstance(by_fn, CallableDiscovery) and by_fn.fn is fn
    with pytest.raises(ValueError, match="discovery must be"):
        make_discovery(3.5, CPU1)


# ---- DiscoveryPoller -----------------------------------------------------------------


def test_poller_returns_what_the_source_offers():
    source = FlakySource()
    source.next = {"node-a": 2}
    poller = DiscoveryPoller(source, give_up_after=60, clock=FakeClock())
    assert poller.poll() == {"node-a": 2}


def test_poller_first_failure_raises_at_once_with_the_source_error():
    source = FlakySource()
    source.next = OSError("inventory down")
    poller = DiscoveryPoller(source, give_up_after=60, clock=FakeClock())
    with pytest.raises(DiscoveryError) as info:
        poller.poll()
    assert "inventory down" in str(info.value)
    assert "flaky-source" in str(info.value)
    assert isinstance(info.value.__cause__, OSError)


def test_poller_retries_later_failures_until_give_up_after(caplog):
    clock = FakeClock(1000.0)
    source = FlakySource()
    source.next = {"node-a": 2}
    poller = DiscoveryPoller(source, give_up_after=60, clock=clock)
    assert poller.poll() == {"node-a": 2}

    source.next = RuntimeError("flaky network")
    with caplog.at_level(logging.WARNING, logger="ray_elastic.discovery"):
        clock.t = 1010.0
        assert poller.poll() is None
        clock.t = 1059.0
        assert poller.poll() is None
    assert any("flaky network" in r.getMessage() for r in caplog.records)

    clock.t = 1061.0
    with pytest.raises(DiscoveryError) as info:
        poller.poll()
    assert "flaky network" in str(info.value)
    assert "61 s" in str(info.value)


def test_poller_success_restarts_the_give_up_window():
    clock = FakeClock(0.0)
    source = FlakySource()
    source.next = {"node-a": 1}
    poller = DiscoveryPoller(source, give_up_after=60, clock=clock)
    poller.poll()

    source.next = RuntimeError("blip")
    clock.t = 50.0
    assert poller.poll() is None
    source.next = {"node-a": 3}
    clock.t = 55.0
    assert poller.poll() == {"node-a": 3}

    source.next = RuntimeError("blip")
    clock.t = 110.0  # 110 s since the first success, but only 55 s since the last one
    assert poller.poll() is None
    clock.t = 116.0
    with pytest.raises(DiscoveryError):
        poller.poll()


def test_poller_wraps_a_failing_script(tmp_path):
    script = write_script(tmp_path, 'echo "no credentials" >&2\nexit 1\n')
    poller = DiscoveryPoller(ScriptDiscovery(str(script), CPU1, nodes=lambda: NODES), give_up_after=60)
    with pytest.raises(DiscoveryError) as info:
        poller.poll()
    assert "no credentials" in str(info.value)


def test_poller_bounds_a_hanging_source_and_retries_it_later():
    import threading

    release = threading.Event()
    calls = []

    def source():
        calls.append(1)
        if len(calls) >= 2:
            assert release.wait(10), "the test never released the hanging call"
        return {"n1": 2}

    poller = DiscoveryPoller(source, give_up_after=60, timeout=0.2)
    assert poller.poll() == {"n1": 2}
    assert poller.poll() is None  # hangs: a warning, the last view stays
    assert poller.poll() is None  # still the same call: no second thread piles up
    assert len(calls) == 2
    release.set()
    assert poller.poll() == {"n1": 2}  # the late answer is taken


def test_poller_first_call_hanging_fails_at_once_naming_the_timeout():
    import threading

    never = threading.Event()
    poller = DiscoveryPoller(lambda: never.wait(5) or {}, give_up_after=60, timeout=0.2)
    with pytest.raises(DiscoveryError, match="did not answer within 0.2 s"):
        poller.poll()
    never.set()
