"""The shared-memory allreduce of ranks on one machine (`ray_elastic.collective.shm`), without Ray.

Real processes over a real torch Gloo ring, their shared ring built over it:
sums bitwise equal to rank-order sums on every rank (across slot pieces,
for float and integer dtypes), nothing left behind in the shared directory,
Gloo kept when one rank is on another machine, and a lost peer ending the
others' wait at once (it exited) or at the driver's abandon (it stalled).
"""

from __future__ import annotations

import shm_ranks
import torch
import torch.multiprocessing as mp

from ray_elastic.collective import shm


def _run(target, world: int, tmp_path, *args, expect: int | None = None) -> list[dict]:
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, str(tmp_path), str(shm_dir), *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        found = [out.get(timeout=90) for _ in range(world if expect is None else expect)]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return sorted(found, key=lambda f: f["rank"])


def test_sums_are_rank_order_sums_bitwise_on_every_rank(tmp_path):
    found = _run(shm_ranks.sums, 3, tmp_path)
    for f in found:
        assert f["built"], f"rank {f['rank']}: ranks on one machine got no shared ring"
        assert f["left"] == [], f"rank {f['rank']}: the build left {f['left']} behind"
        for dtype, n in shm_ranks.CASES:
            want = shm_ranks.expected_sum(3, dtype, n).numpy().tobytes()
            assert f[(str(dtype), n)] == want, f"rank {f['rank']}: the sum of {n} x {dtype} is not the rank-order sum"


def test_ranks_on_different_machines_keep_gloo(tmp_path):
    found = _run(shm_ranks.unshared, 3, tmp_path)
    assert [f["built"] for f in found] == [False] * 3, "one rank elsewhere: no rank may use a shared ring"
    assert all(f["gloo_sum"] == [6.0] * 4 for f in found)
    assert all(f["left"] == [] for f in found), "the segment rank 0 made must be gone"


def test_a_peer_that_exits_ends_the_others_sum_at_once(tmp_path):
    found = _run(shm_ranks.peer_lost, 3, tmp_path, "exit", expect=2)
    for f in found:
        assert f["error"] and "rank 2" in f["error"], f"rank {f['rank']}: {f['error']}"
        assert f["took"] < 5.0, f"rank {f['rank']} waited {f['took']:.1f} s for a rank that had exited"
        assert f["again"] and "not started" in f["again"], "a broken ring must refuse the next sum at once"


def test_the_drivers_abandon_ends_a_wait_on_a_stalled_peer(tmp_path):
    found = _run(shm_ranks.peer_lost, 3, tmp_path, "stall", expect=2)
    for f in found:
        assert f["error"] and "abandoned" in f["error"] and "rank 2" in f["error"], f["error"]
        assert 0.9 < f["took"] < 5.0, f"rank {f['rank']} left after {f['took']:.2f} s; the abandon came at 1 s"


def test_which_tensors_it_takes_and_how_big_its_slots_are():
    assert shm.can_reduce([torch.zeros(8)], True)
    assert not shm.can_reduce([torch.zeros(8)], False), "only sums"
    assert not shm.can_reduce([torch.zeros(8), torch.zeros(8)], True), "one tensor per call"
    assert not shm.can_reduce([torch.zeros(4, 4).t()], True), "contiguous only"
    assert not shm.can_reduce([torch.zeros(8, dtype=torch.bool)], True)
    assert shm.slot_bytes_for(2) == shm.SLOT_BYTES
    assert (shm.slot_bytes_for(64) * 65) <= shm.MAX_SEGMENT_BYTES, "the segment stays within its bound"
    assert shm.slot_bytes_for(64) % 4096 == 0
