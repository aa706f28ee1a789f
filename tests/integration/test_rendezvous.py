"""The rendezvous KV actor on a real Ray: generation-scoped keys, server-side waits.

Each test starts its own KV actor (`create_kv_actor`) in a fresh namespace on
the session's cluster and kills it afterwards. Waits are shown to block inside
the actor until another client writes, and to be released at once by a newer
generation; every failed wait must name what it waited for. The last tests go
through the `torch.distributed.Store` adapter that the Gloo backend uses.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from datetime import timedelta

import pytest
import ray
import torch.distributed as dist

from ray_elastic.auth import RunToken
from ray_elastic.collective.torch_store import KVTorchStore, torch_store
from ray_elastic.exceptions import GenerationSupersededError, RendezvousTimeoutError
from ray_elastic.rendezvous import KVClient, create_kv_actor, decode_family

# the workers cannot import this module: Ray's own cloudpickle ships its functions by value
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.integration

# how long a call must stay unanswered to count as blocked (an assertion, not a sync point)
STILL_BLOCKED_S = 0.3


def new_kv() -> ray.actor.ActorHandle:
    namespace = f"ray_elastic_test_kv_{uuid.uuid4().hex[:8]}"
    handle = create_kv_actor(f"run-{namespace}", namespace, RunToken())
    ray.get(handle.current_generation.remote(), timeout=60)  # started and answering
    return handle


@pytest.fixture
def kv(cluster):
    handle = new_kv()
    yield handle
    ray.kill(handle.handle)


def assert_ref_blocked(ref: ray.ObjectRef) -> None:
    ready, _ = ray.wait([ref], timeout=STILL_BLOCKED_S)
    assert not ready, "the call returned before the key it waits for was written"


@ray.remote(num_cpus=0)
def set_from_another_process(handle: ray.actor.ActorHandle, generation: int, key: str, value: bytes) -> None:
    KVClient(handle).set(generation, key, value)


# ---- server-side waits ------------------------------------------------------------


def test_get_blocks_in_the_actor_until_another_process_sets_the_key(kv):
    ray.get(kv.publish.remote(1, {}), timeout=10)
    ref = kv.get.remote(1, "rank0/addr", 30.0)
    assert_ref_blocked(ref)

    ray.get(set_from_another_process.remote(kv, 1, "rank0/addr", b"10.0.0.1:29500"), timeout=60)

    assert ray.get(ref, timeout=10) == b"10.0.0.1:29500"


def test_client_wait_in_a_thread_returns_only_once_every_key_is_set(kv):
    client = KVClient(kv)
    ray.get(kv.publish.remote(1, {}), timeout=10)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(client.wait, 1, ["a", "b"], 30.0)
        getting = pool.submit(client.get, 1, "b", 30.0)  # queued behind the wait in the one thread
        client.set(1, "a", b"1")
        with pytest.raises(FutureTimeoutError):
            waiting.result(timeout=STILL_BLOCKED_S)  # "b" is still missing

        client.set(1, "b", b"2")

        waiting.result(timeout=10)
        assert getting.result(timeout=10) == b"2"
    assert client.multi_get(1, ["a", "b"], 1.0) == [b"1", b"2"]


def test_get_of_a_missing_key_times_out_naming_the_key(kv):
    ray.get(kv.publish.remote(1, {}), timeout=10)
    start = time.monotonic()
    with pytest.raises(RendezvousTimeoutError, match="never-written-key"):
        KVClient(kv).get(1, "never-written-key", 0.5)
    assert time.monotonic() - start < 5


# ---- generations --------------------------------------------------------------------


def test_a_newer_generation_releases_waits_of_the_old_one_at_once(kv):
    ray.get(kv.publish.remote(1, {}), timeout=10)
    client = KVClient(kv)
    ref = kv.get.remote(1, "peer-that-died/addr", 60.0)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(client.wait, 1, ["other-peer"], 60.0)
        assert_ref_blocked(ref)

        start = time.monotonic()
        ray.get(kv.publish.remote(2, {"world_size": 1}), timeout=10)

        with pytest.raises(GenerationSupersededError):
            ray.get(ref, timeout=10)
        with pytest.raises(GenerationSupersededError):
            waiting.result(timeout=10)
    assert time.monotonic() - start < 5, "superseded waits should be released far below their 60 s timeout"


def test_keys_of_an_older_generation_are_gone_after_publish(kv):
    client = KVClient(kv)
    ray.get(kv.publish.remote(1, {}), timeout=10)
    client.set(1, "gen1-only-key", b"stale")
    client.set(2, "early-gen2-key", b"fresh")  # a newcomer may write ahead of the publish
    assert client.num_keys(1) == 1

    ray.get(kv.publish.remote(2, {}), timeout=10)

    assert client.num_keys(1) == 0
    assert client.num_keys(2) == 1
    assert not client.check(2, ["gen1-only-key"])
    with pytest.raises(RendezvousTimeoutError, match="gen1-only-key"):
        client.get(2, "gen1-only-key", timeout=0.5)
    assert client.get(2, "early-gen2-key", timeout=1.0) == b"fresh"
    # a straggler of generation 1 can neither read nor write any more
    with pytest.raises(GenerationSupersededError):
        client.get(1, "gen1-only-key", timeout=5.0)
    with pytest.raises(GenerationSupersededError):
        client.set(1, "gen1-only-key", b"late")
    assert client.num_keys(1) == 0


def test_wait_generation_blocks_until_publish_and_returns_the_assignment(kv):
    ref = kv.wait_generation.remote(0, 30.0)
    assert_ref_blocked(ref)

    ray.get(kv.publish.remote(1, {"ranks": {"w1": 0, "w2": 1}}), timeout=10)

    assert ray.get(ref, timeout=10) == (1, {"ranks": {"w1": 0, "w2": 1}})


def test_wait_generation_returns_the_newest_generation_at_once(kv):
    client = KVClient(kv)
    for g in (1, 2, 3):
        ray.get(kv.publish.remote(g, {"world_size": g}), timeout=10)
    start = time.monotonic()
    assert client.wait_generation(1, 30.0) == (3, {"world_size": 3})
    assert client.wait_generation(0, 30.0) == (3, {"world_size": 3})
    assert time.monotonic() - start < 5


def test_wait_generation_times_out_naming_what_it_waited_for(kv):
    ray.get(kv.publish.remote(3, {}), timeout=10)
    start = time.monotonic()
    with pytest.raises(RendezvousTimeoutError, match="generation after 3"):
        KVClient(kv).wait_generation(3, 0.5)
    assert time.monotonic() - start < 5


def test_publish_of_a_generation_that_is_not_newer_is_refused(kv):
    ray.get(kv.publish.remote(2, {"world_size": 2}), timeout=10)
    for stale in (2, 1):
        with pytest.raises(ValueError, match="not newer"):
            ray.get(kv.publish.remote(stale, {"world_size": 99}), timeout=10)
    assert ray.get(kv.current_generation.remote(), timeout=10) == 2
    assert KVClient(kv).wait_generation(1, 1.0) == (2, {"world_size": 2})


# ---- the key operations -----------------------------------------------------------


def test_add_counts_atomically_across_concurrent_callers(kv):
    client = KVClient(kv)
    assert client.add(1, "steps", 5) == 5
    assert client.add(1, "steps", -2) == 3
    assert client.get(1, "steps", 1.0) == b"3"

    with ThreadPoolExecutor(4) as pool:
        returned = list(pool.map(lambda _: client.add(1, "joined", 1), range(40)))
    assert sorted(returned) == list(range(1, 41))
    assert client.get(1, "joined", 1.0) == b"40"


def test_compare_set_semantics(kv):
    client = KVClient(kv)
    # on a missing key: expected b"" creates it, anything else leaves it missing
    assert client.compare_set(1, "absent", b"x", b"y") == b"x"
    assert not client.check(1, ["absent"])
    assert client.compare_set(1, "leader", b"", b"w1") == b"w1"
    assert client.get(1, "leader", 1.0) == b"w1"
    # on a present key: a wrong expectation returns the current value and changes nothing
    assert client.compare_set(1, "leader", b"", b"w2") == b"w1"
    assert client.compare_set(1, "leader", b"w9", b"w2") == b"w1"
    assert client.get(1, "leader", 1.0) == b"w1"
    assert client.compare_set(1, "leader", b"w1", b"w2") == b"w2"
    assert client.get(1, "leader", 1.0) == b"w2"


def test_check_delete_and_num_keys_are_per_generation(kv):
    client = KVClient(kv)
    ray.get(kv.publish.remote(1, {}), timeout=10)
    client.multi_set(1, [("a", b"1"), ("b", b"2"), ("c", b"3")])
    client.set(2, "a", b"next")
    assert client.num_keys(1) == 3
    assert client.num_keys(2) == 1
    assert client.check(1, ["a", "b"])
    assert not client.check(1, ["a", "missing"])
    assert client.check(1, [])

    assert client.delete_key(1, "a") is True
    assert client.delete_key(1, "a") is False
    assert not client.check(1, ["a"])
    assert client.check(2, ["a"]), "deleting generation 1's key must not touch generation 2's"
    assert client.num_keys(1) == 2
    assert client.num_keys(2) == 1


def test_two_runs_in_different_namespaces_do_not_see_each_others_keys(kv):
    other = new_kv()
    try:
        mine, theirs = KVClient(kv), KVClient(other)
        mine.set(1, "rank0/addr", b"mine")
        assert theirs.num_keys(1) == 0
        assert not theirs.check(1, ["rank0/addr"])
        with pytest.raises(RendezvousTimeoutError, match="rank0/addr"):
            theirs.get(1, "rank0/addr", 0.5)
        theirs.set(1, "rank0/addr", b"theirs")
        assert mine.get(1, "rank0/addr", 1.0) == b"mine"
        assert theirs.get(1, "rank0/addr", 1.0) == b"theirs"
        ray.get(other.publish.remote(5, {}), timeout=10)
        assert ray.get(kv.current_generation.remote(), timeout=10) == 0
    finally:
        ray.kill(other.handle)


def test_a_call_without_the_runs_token_is_refused(kv):
    """Any job on the cluster can find a run's named KV actor; it must not be able to publish on it."""
    with pytest.raises(PermissionError, match="KVStore.publish refused a call without this run's token"):
        ray.get(kv.handle.publish.remote(7, {"world_size": 99}), timeout=10)
    with pytest.raises(PermissionError, match="without this run's token"):
        ray.get(kv.handle.publish.remote("a guessed token", 7, {"world_size": 99}), timeout=10)
    assert ray.get(kv.current_generation.remote(), timeout=10) == 0
    assert "hidden" in repr(kv._token) and kv._token.value not in repr(kv)


# ---- the torch.distributed.Store adapter ------------------------------------------


def test_torch_store_adapter_does_the_store_operations_in_its_generation(kv):
    client = KVClient(kv)
    ray.get(kv.publish.remote(1, {}), timeout=10)
    store = torch_store(client, 1, timeout=5.0)
    assert isinstance(store, KVTorchStore)
    assert isinstance(store, dist.Store)

    store.set("addr", "10.0.0.1")
    store.set("raw", b"\x00\xff")
    assert store.get("addr") == b"10.0.0.1"
    assert store.get("raw") == b"\x00\xff"
    assert client.get(1, "addr", 1.0) == b"10.0.0.1"
    assert store.add("count", 2) == 2
    assert store.add("count", 3) == 5
    store.wait(["addr", "count"])
    store.wait(["addr"], timedelta(seconds=1))
    with pytest.raises(RendezvousTimeoutError, match="late-key"):
        store.wait(["late-key"], timedelta(seconds=0.3))
    assert store.check(["addr", "count"])
    assert not store.check(["addr", "late-key"])
    assert store.compare_set("cs", "", "v1") == b"v1"
    assert store.compare_set("cs", "wrong", "v2") == b"v1"
    assert store.compare_set("cs", "v1", "v2") == b"v2"
    assert store.num_keys() == 4
    assert store.delete_key("cs") is True
    assert store.num_keys() == 3

    # the next generation's store does not see this generation's keys
    with pytest.raises(RendezvousTimeoutError, match="addr"):
        torch_store(client, 2, timeout=0.3).get("addr")


def test_torch_prefix_store_works_on_top_of_the_adapter(kv):
    client = KVClient(kv)
    ray.get(kv.publish.remote(1, {}), timeout=10)
    # torch forgets a Python Store's methods once the Python object is collected: keep it referenced
    base = torch_store(client, 1, timeout=5.0)
    store = dist.PrefixStore("x", base)

    store.set("k", "v")
    assert store.get("k") == b"v"
    assert client.get(1, "x/k", 1.0) == b"v"
    assert store.add("n", 4) == 4
    assert store.add("n", 1) == 5
    store.wait(["k", "n"])
    assert store.check(["k"])
    assert not store.check(["absent"])
    assert store.compare_set("cs", "", "first") == b"first"
    assert client.get(1, "x/cs", 1.0) == b"first"
    with pytest.raises(RendezvousTimeoutError, match="x/absent"):
        store.wait(["absent"], timedelta(seconds=0.3))
    # torch's C++ side calls these two under their C++ names (getNumKeys, deleteKey)
    assert store.num_keys() == 3
    assert store.delete_key("cs") is True
    assert not client.check(1, ["x/cs"])


# ---- traffic per generation ---------------------------------------------------------


def calls(kv: ray.actor.ActorHandle) -> int:
    return ray.get(kv.stats.remote(), timeout=10)["calls"]


def test_wait_generation_with_a_worker_id_returns_only_that_workers_entry(kv):
    plan = {f"w{i}": {"rank": i} for i in range(50)}
    ray.get(kv.publish.remote(1, plan), timeout=10)
    client = KVClient(kv)
    assert client.wait_generation(0, 5.0, "w7") == (1, {"w7": {"rank": 7}})
    assert client.wait_generation(0, 5.0, "not-admitted") == (1, {})
    assert client.wait_generation(0, 5.0) == (1, plan)


def test_wait_family_returns_every_ranks_value_once_all_exist_in_one_call(kv):
    ray.get(kv.publish.remote(1, {}), timeout=10)
    client = KVClient(kv)
    client.set(1, "pg/0", b"a")
    ref = kv.wait_family.remote(1, "pg/", 3, 30.0)
    client.set(1, "pg/2", b"c")
    assert_ref_blocked(ref)  # rank 1 is still missing
    client.set(1, "pg/1", b"b")
    assert decode_family(ray.get(ref, timeout=10)[0]) == [b"a", b"b", b"c"]
    assert client.wait_family(1, "pg/", 3, 1.0) == [b"a", b"b", b"c"]
    with pytest.raises(RendezvousTimeoutError, match="pg/3"):
        client.wait_family(1, "pg/", 4, 0.3)


def test_per_rank_keys_are_read_in_one_call_and_other_keys_every_time(kv):
    client = KVClient(kv)
    ray.get(kv.publish.remote(1, {}), timeout=10)
    client.multi_set(1, [(f"x/{r}", f"addr{r}".encode()) for r in range(4)] + [("x/9", b"not-a-rank")])
    store = torch_store(client, 1, timeout=5.0, world_size=4)
    before = calls(kv)
    assert [store.get(f"x/{r}") for r in range(4)] == [b"addr0", b"addr1", b"addr2", b"addr3"]
    store.wait([f"x/{r}" for r in range(4)])
    assert calls(kv) - before == 1, "the four per-rank keys should cost one call"
    # a key beyond the world size, or not of the `<prefix>/<rank>` form, is read from the actor each time
    client.set(1, "x/9", b"changed")
    assert store.get("x/9") == b"changed"
    store.set("counter", "1")
    assert store.get("counter") == b"1"
    with pytest.raises(RendezvousTimeoutError, match="y/2"):
        store.wait(["y/2"], timedelta(seconds=0.3))


def test_wait_family_can_write_the_callers_own_key_in_the_same_call(kv):
    ray.get(kv.publish.remote(1, {}), timeout=10)
    client = KVClient(kv)
    client.set(1, "pg/0", b"a")
    before = calls(kv)
    ref = kv.wait_family.remote(1, "pg/", 2, 30.0, ("pg/1", b"b"))
    assert decode_family(ray.get(ref, timeout=10)[0]) == [b"a", b"b"]
    assert calls(kv) - before == 1
    assert client.get(1, "pg/1", 1.0) == b"b", "the write is visible to every other client"
    # a rank whose peers are not there yet still announces itself: a peer's read then sees it
    waiting = kv.wait_family.remote(1, "q/", 2, 30.0, ("q/1", b"one"))
    assert_ref_blocked(waiting)
    assert client.wait_family(1, "q/", 2, 5.0, ("q/0", b"zero")) == [b"zero", b"one"]
    assert decode_family(ray.get(waiting, timeout=10)[0]) == [b"zero", b"one"]


def test_a_family_wait_of_an_older_generation_is_released_at_once_by_a_newer_one(kv):
    """A rank forming a ring with a peer that died is freed by the next generation, not its timeout."""
    ray.get(kv.publish.remote(1, {}), timeout=10)
    waiting = kv.wait_family.remote(1, "pg/", 2, 60.0, ("pg/0", b"mine"))
    assert_ref_blocked(waiting)
    start = time.monotonic()
    ray.get(kv.publish.remote(2, {}), timeout=10)
    with pytest.raises(GenerationSupersededError):
        ray.get(waiting, timeout=10)
    assert time.monotonic() - start < 5
    # the new generation's family starts from nothing: the old generation's key does not count
    client = KVClient(kv)
    with pytest.raises(RendezvousTimeoutError, match=r"pg/0"):
        client.wait_family(2, "pg/", 2, 0.3, ("pg/1", b"peer"))


def test_a_family_counts_each_key_once_and_a_deleted_key_as_missing_again(kv):
    ray.get(kv.publish.remote(1, {}), timeout=10)
    client = KVClient(kv)
    client.set(1, "f/0", b"a")
    waiting = kv.wait_family.remote(1, "f/", 3, 30.0)
    client.set(1, "f/0", b"a2")  # written twice: still one of three
    client.set(1, "f/1", b"b")
    client.set(1, "f/01", b"not rank 1")  # not a rank key of the family
    client.set(1, "f/7", b"beyond the family")
    assert client.delete_key(1, "f/1")
    client.set(1, "f/2", b"c")
    assert_ref_blocked(waiting)  # f/1 is missing again
    client.set(1, "f/1", b"b2")
    assert decode_family(ray.get(waiting, timeout=10)[0]) == [b"a2", b"b2", b"c"]


def test_many_ranks_waiting_for_one_family_are_all_answered_whatever_the_write_order(kv):
    """Every rank writes its key and waits in the same call, arriving in reverse rank order."""
    ray.get(kv.publish.remote(1, {}), timeout=10)
    size = 64
    refs = [
        kv.wait_family.remote(1, "ring/", size, 30.0, (f"ring/{r}", f"addr{r}".encode())) for r in reversed(range(size))
    ]
    expected = [f"addr{r}".encode() for r in range(size)]
    for ref in refs:
        assert decode_family(ray.get(ref, timeout=30)[0]) == expected


def test_a_family_too_large_to_answer_inline_comes_by_object_reference(kv):
    """Values that do not compress under the inline limit still reach every rank, through the object store."""
    ray.get(kv.publish.remote(1, {}), timeout=10)
    client = KVClient(kv)
    values = [os.urandom(2048) for _ in range(64)]  # 128 KiB that do not compress
    client.multi_set(1, [(f"big/{r}", v) for r, v in enumerate(values)])
    (reply,) = ray.get(kv.wait_family.remote(1, "big/", 64, 10.0), timeout=10)
    assert isinstance(reply, ray.ObjectRef)
    assert decode_family(reply) == values
    assert client.wait_family(1, "big/", 64, 10.0) == values


def test_a_wait_for_many_keys_returns_whatever_order_they_are_written_in(kv):
    ray.get(kv.publish.remote(1, {}), timeout=10)
    client = KVClient(kv)
    keys = [f"k/{i}" for i in range(50)]
    ref = kv.multi_get.remote(1, keys, 30.0)
    for i in [*range(49, 24, -1), *range(0, 25)]:  # the last half backwards, then the first half
        client.set(1, keys[i], str(i).encode())
    assert ray.get(ref, timeout=10) == [str(i).encode() for i in range(50)]


def test_a_held_back_rank_key_is_sent_before_any_other_operation(kv):
    """The store holds its own `<prefix>/<rank>` write for the family read, but never past another call."""
    ray.get(kv.publish.remote(1, {}), timeout=10)
    client = KVClient(kv)
    store = torch_store(client, 1, timeout=5.0, world_size=2)
    store.set("x/0", b"mine")
    assert store.add("counter", 1) == 1
    assert client.get(1, "x/0", 1.0) == b"mine", "the held write went out before the add"
    store.set("y/0", b"held")
    client.set(1, "y/1", b"peer")
    before = calls(kv)
    assert store.get("y/1") == b"peer"
    assert calls(kv) - before == 1, "the held write rides on the family read"
    assert client.get(1, "y/0", 1.0) == b"held"


def test_a_gloo_ring_of_four_costs_each_rank_one_call(kv):
    """N calls for the ring instead of Gloo's 2N^2 + N key-at-a-time reads."""
    ray.get(kv.publish.remote(1, {}), timeout=10)
    size = 4
    before = calls(kv)
    stores = [torch_store(KVClient(kv), 1, timeout=30.0, world_size=size) for _ in range(size)]

    def member(rank: int) -> float:
        import torch

        group = dist.ProcessGroupGloo(dist.PrefixStore("default_pg", stores[rank]), rank, size, timedelta(seconds=30))
        t = torch.tensor([float(rank)])
        group.allreduce([t]).wait()
        return t.item()

    with ThreadPoolExecutor(size) as pool:
        sums = list(pool.map(member, range(size), timeout=60))

    assert sums == [6.0] * size
    assert calls(kv) - before == size
