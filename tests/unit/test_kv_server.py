"""The KV actor's logic (`kv_server.KVServer`) under plain asyncio: no Ray is started.

Generation fencing, server-side waits woken by the write they wait for,
superseded generations releasing their waiters at once, family counting
(`wait_family`), deletes and timeouts, each in milliseconds. The same logic on
Ray, with clients in other processes, is in tests/integration/test_rendezvous.py.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from ray_elastic.exceptions import GenerationSupersededError, RendezvousTimeoutError
from ray_elastic.kv_server import KVServer, pack_family, unpack_family

# how long a waiter must stay pending to count as blocked (an assertion, not a sync point)
STILL_BLOCKED_S = 0.05


def run(coro_fn):
    """Run `coro_fn(server)` on a fresh event loop with a fresh server holding generation 1."""

    async def main():
        server = KVServer("test-run")
        await server.publish(1, {})
        return await coro_fn(server)

    return asyncio.run(main())


async def blocked(task: asyncio.Task) -> bool:
    await asyncio.sleep(STILL_BLOCKED_S)
    return not task.done()


def family(server: KVServer, *args) -> asyncio.Task:
    return asyncio.ensure_future(server.wait_family(*args))


# ---- keys and waits -------------------------------------------------------------------


def test_get_waits_for_the_set_that_writes_its_key():
    async def scenario(server):
        getting = asyncio.ensure_future(server.get(1, "rank0/addr", 10.0))
        assert await blocked(getting)
        await server.set(1, "rank0/addr", b"10.0.0.1:29500")
        return await asyncio.wait_for(getting, 1)

    assert run(scenario) == b"10.0.0.1:29500"


def test_a_wait_for_several_keys_returns_once_the_last_is_written_in_any_order():
    async def scenario(server):
        waiting = asyncio.ensure_future(server.multi_get(1, ["a", "b", "c"], 10.0))
        await server.set(1, "c", b"3")
        await server.multi_set(1, [("a", b"1")])
        assert await blocked(waiting)
        await server.set(1, "b", b"2")
        return await asyncio.wait_for(waiting, 1)

    assert run(scenario) == [b"1", b"2", b"3"]


def test_a_wait_times_out_in_its_own_time_naming_the_missing_keys():
    async def scenario(server):
        await server.set(1, "here", b"x")
        start = time.monotonic()
        with pytest.raises(RendezvousTimeoutError, match="never-written") as e:
            await server.wait(1, ["here", "never-written"], 0.2)
        assert "here'" not in str(e.value), "only the missing key is named"
        return time.monotonic() - start

    assert 0.15 <= run(scenario) < 2


def test_a_key_deleted_before_the_wait_ends_is_waited_for_again():
    async def scenario(server):
        await server.set(1, "a", b"1")
        assert await server.delete_key(1, "a") is True
        assert await server.delete_key(1, "a") is False, "a second delete finds nothing"
        assert await server.check(1, ["a"]) is False
        waiting = asyncio.ensure_future(server.get(1, "a", 10.0))
        assert await blocked(waiting)
        await server.set(1, "a", b"again")
        return await asyncio.wait_for(waiting, 1), await server.num_keys(1)

    assert run(scenario) == (b"again", 1)


def test_add_and_compare_set_are_torch_store_semantics():
    async def scenario(server):
        assert await server.add(1, "count", 2) == 2
        assert await server.add(1, "count", 3) == 5
        assert await server.compare_set(1, "k", b"", b"first") == b"first", "absent and expected empty: set"
        assert await server.compare_set(1, "k", b"wrong", b"second") == b"first", "mismatch: the current value"
        assert await server.compare_set(1, "k", b"first", b"second") == b"second"
        assert await server.compare_set(1, "absent", b"x", b"y") == b"x", "absent, non-empty expected: unchanged"
        return await server.check(1, ["count", "k"]), await server.check(1, ["absent"])

    assert run(scenario) == (True, False)


# ---- generations ----------------------------------------------------------------------


def test_publish_releases_every_wait_of_an_older_generation_at_once():
    async def scenario(server):
        getting = asyncio.ensure_future(server.get(1, "peer-that-died/addr", 60.0))
        waiting = asyncio.ensure_future(server.wait(1, ["other"], 60.0))
        ring = family(server, 1, "ring/", 3, 60.0, ("ring/0", b"me"))
        assert await blocked(getting) and await blocked(waiting) and await blocked(ring)
        start = time.monotonic()
        await server.publish(2, {})
        for task in (getting, waiting, ring):
            with pytest.raises(GenerationSupersededError, match="generation 1 superseded by 2"):
                await asyncio.wait_for(task, 1)
        return time.monotonic() - start

    assert run(scenario) < 1, "superseded waits end far below their 60 s timeout"


def test_a_restore_by_a_restarted_driver_releases_the_older_generations_waits_as_a_publish_does():
    """The dead driver saved generation 2 but never published it: its restore must free generation 1's waiters."""

    async def scenario(server):
        getting = asyncio.ensure_future(server.get(1, "peer-that-died/addr", 60.0))
        ring = family(server, 1, "ring/", 3, 60.0, ("ring/0", b"me"))
        assert await blocked(getting) and await blocked(ring)
        start = time.monotonic()
        await server.restore(2, {"w1": "slot"})
        for task in (getting, ring):
            with pytest.raises(GenerationSupersededError, match="generation 1 superseded by 2"):
                await asyncio.wait_for(task, 1)
        assert await server.num_keys(1) == 0
        return time.monotonic() - start

    assert run(scenario) < 1, "superseded waits end far below their 60 s timeout"


def test_keys_are_fenced_by_generation():
    async def scenario(server):
        await server.set(1, "addr", b"old")
        await server.publish(2, {})
        assert await server.num_keys(1) == 0, "an older generation's keys go at publish"
        assert await server.check(2, ["addr"]) is False, "generation 2 never reads generation 1's keys"
        for call in (server.set(1, "addr", b"late"), server.get(1, "addr", 1.0), server.add(1, "n", 1)):
            with pytest.raises(GenerationSupersededError):
                await call
        await server.set(3, "ahead", b"ok")  # a key of a generation not yet published is accepted
        return (await server.stats())["generation"]

    assert run(scenario) == 2


def test_publish_refuses_a_generation_that_is_not_newer():
    async def scenario(server):
        with pytest.raises(ValueError, match="not newer"):
            await server.publish(1, {})

    run(scenario)


def test_wait_generation_returns_the_newest_and_only_the_callers_slot():
    async def scenario(server):
        waiting = asyncio.ensure_future(server.wait_generation(1, 10.0, "w2"))
        assert await blocked(waiting)
        await server.publish(2, {"w1": "slot1", "w2": "slot2"})
        mine = await asyncio.wait_for(waiting, 1)
        left_out = await server.wait_generation(1, 1.0, "w9")
        everyone = await server.wait_generation(0, 1.0)
        return mine, left_out, everyone

    assert run(scenario) == ((2, {"w2": "slot2"}), (2, {}), (2, {"w1": "slot1", "w2": "slot2"}))


def test_wait_generation_times_out_naming_the_generation_it_waited_after():
    async def scenario(server):
        with pytest.raises(RendezvousTimeoutError, match="generation after 1"):
            await server.wait_generation(1, 0.1)

    run(scenario)


# ---- families ---------------------------------------------------------------------------


def test_a_family_answers_every_rank_once_all_keys_exist_whatever_the_order():
    async def scenario(server):
        size = 5
        ranks = [family(server, 1, "ring/", size, 10.0, (f"ring/{r}", f"addr{r}".encode())) for r in (4, 2, 0, 3)]
        assert all([await blocked(task) for task in ranks])
        last = await server.wait_family(1, "ring/", size, 10.0, ("ring/1", b"addr1"))
        replies = [last] + [await asyncio.wait_for(task, 1) for task in ranks]
        return [unpack_family(reply) for (reply,) in replies]

    expected = [f"addr{r}".encode() for r in range(5)]
    assert run(scenario) == [expected] * 5


def test_a_family_counts_a_deleted_key_as_missing_again():
    async def scenario(server):
        await server.multi_set(1, [("f/0", b"a")])
        waiting = family(server, 1, "f/", 2, 10.0)
        await server.delete_key(1, "f/0")
        await server.set(1, "f/1", b"b")
        assert await blocked(waiting), "f/0 was deleted: the family is incomplete"
        await server.set(1, "f/0", b"a2")
        (reply,) = await asyncio.wait_for(waiting, 1)
        return unpack_family(reply)

    assert run(scenario) == [b"a2", b"b"]


def test_keys_that_only_look_like_family_members_do_not_count():
    async def scenario(server):
        waiting = family(server, 1, "f/", 2, 10.0)
        await server.multi_set(1, [("f/00", b"x"), ("f/2", b"x"), ("f/a", b"x"), ("g/1", b"x"), ("f/0", b"zero")])
        assert await blocked(waiting), "only f/0 and f/1 belong to a family of two"
        await server.set(1, "f/1", b"one")
        (reply,) = await asyncio.wait_for(waiting, 1)
        return unpack_family(reply)

    assert run(scenario) == [b"zero", b"one"]


def test_a_family_times_out_naming_the_missing_keys():
    async def scenario(server):
        with pytest.raises(RendezvousTimeoutError, match="ring/1"):
            await server.wait_family(1, "ring/", 2, 0.1, ("ring/0", b"me"))

    run(scenario)


def test_a_complete_familys_values_are_packed_once_and_shared_by_every_rank():
    class CountingServer(KVServer):
        shared = 0

        def share_reply(self, packed: bytes) -> bytes:
            CountingServer.shared += 1
            return packed

    async def main():
        server = CountingServer("test-run")
        await server.publish(1, {})
        await server.multi_set(1, [(f"f/{r}", bytes([r])) for r in range(3)])
        replies = [await server.wait_family(1, "f/", 3, 1.0) for _ in range(3)]
        return replies, (await server.stats())["calls"]

    replies, calls = asyncio.run(main())
    assert CountingServer.shared == 1
    assert all(r == replies[0] for r in replies) and unpack_family(replies[0][0]) == [b"\0", b"\1", b"\2"]
    assert calls == 4, "one multi_set and one call per rank"


def test_pack_family_round_trips_and_compresses_padding():
    values = [b"addr" + bytes(1000) for _ in range(8)]
    packed = pack_family(values)
    assert unpack_family(packed) == values
    assert len(packed) < sum(map(len, values)) // 10


def test_a_restarted_server_learns_the_generation_and_refuses_older_writes():
    async def scenario(_):
        fresh = KVServer("test-run")  # what Ray's restart gives: empty, generation 0
        joining = asyncio.ensure_future(fresh.wait_generation(0, 10.0, "w1"))
        assert await blocked(joining), "a worker waiting for a generation waits for the restore"
        await fresh.restore(4, {"w1": "slot"})
        assert await asyncio.wait_for(joining, 1) == (4, {"w1": "slot"})
        await fresh.restore(3, {})  # an older restore (late) changes nothing
        assert await fresh.current_generation() == 4
        with pytest.raises(GenerationSupersededError):
            await fresh.set(3, "rank0/addr", b"stale")  # fencing by generation holds across the restart
        await fresh.note(3, "gloo-address/0", b"stale")  # a write nobody waits for is dropped, not raised
        assert await fresh.num_keys(3) == 0

    run(scenario)
