"""The straggler policy on scripted paces (pure: no Ray, no clock).

Each scenario gives every rank its compute and wait per step for each
1.5 s interval, as the ranks' pace meters would ship them, and checks what a
user would see: who is let go, who is kept and why, and the cool-down.
"""

from __future__ import annotations

import pytest

from ray_elastic.driver.core.stragglers import WINDOW, Probation, Straggler, judge_stragglers
from ray_elastic.protocol import PaceSummary

HEALTHY = (0.030, 0.005)  # compute, wait per step (s)


def summaries(intervals: list[tuple[float, float]], generation: int = 1) -> list[PaceSummary]:
    """One summary per (compute, wait) per step, 1.5 s of steps each."""
    out, t = [], 1000.0
    for compute, wait in intervals:
        steps = max(1, round(1.5 / (compute + wait)))
        out.append(PaceSummary(generation, t, t + 1.5, steps, compute * steps, wait * steps))
        t += 1.5
    return out


def run(n: int = 4, **special: list[tuple[float, float]]) -> dict[str, list[PaceSummary]]:
    """`n` ranks w0..w(n-1) at the healthy pace for a full window, but those named in `special`."""
    return {f"w{i}": summaries(special.get(f"w{i}", [HEALTHY] * WINDOW)) for i in range(n)}


def slow(factor: float, intervals: int = WINDOW, then: int = 0) -> list[tuple[float, float]]:
    """`then` healthy intervals, then `intervals` at `factor` times the healthy compute (it waits for nobody)."""
    return [HEALTHY] * then + [(HEALTHY[0] * factor, HEALTHY[1])] * intervals


def waiting_for(factor: float) -> list[tuple[float, float]]:
    """A healthy rank in a ring with a straggler: it waits for the straggler's extra compute."""
    return [(HEALTHY[0], HEALTHY[1] + HEALTHY[0] * (factor - 1))] * WINDOW


def judge(paces, min_workers: int = 1, evict: bool = True):
    return judge_stragglers(paces, generation=1, min_workers=min_workers, evict=evict)


def test_a_gc_pause_is_not_a_straggler():
    pause = [HEALTHY] * WINDOW
    pause[4] = (HEALTHY[0] + 1.0 / 43, HEALTHY[1])  # a 1 s pause inside one interval of ~43 steps
    verdict = judge(run(w2=pause))
    assert verdict.verdict is Straggler.NONE, verdict.reason


def test_a_checkpoint_write_slowing_rank_0_for_seconds_is_not_a_straggler():
    # rank 0 at a third of its speed for 4.5 s (three intervals) while it writes a checkpoint
    write = [HEALTHY] * 3 + [(HEALTHY[0] * 3, HEALTHY[1])] * 3 + [HEALTHY] * 4
    assert judge(run(w0=write)).verdict is Straggler.NONE


def test_a_persistent_slowdown_is_evicted_with_its_paces_and_the_prediction():
    verdict = judge(run(w0=waiting_for(3), w1=waiting_for(3), w2=waiting_for(3), w3=slow(3)))
    assert (verdict.verdict, verdict.worker) == (Straggler.EVICT, "w3")
    # 4 workers at 90 + 5 ms against 3 at 4/3 x (30 + 5) ms
    assert verdict.speedup == pytest.approx(95 / (4 / 3 * 35), rel=0.02)
    for text in ("w3 computes 90.0 ms per step", "3.0x the others' median 30.0 ms", "4 workers 95.0 ms", "3 workers"):
        assert text in verdict.reason


def test_a_slowdown_just_begun_waits_for_the_window():
    assert judge(run(w3=slow(3, intervals=5, then=5))).verdict is Straggler.NONE
    assert judge(run(w3=slow(3, intervals=8, then=2))).verdict is Straggler.EVICT


def test_a_straggler_whose_absence_would_be_slower_is_kept():
    # two workers, one 1.6x slower: alone, the other would take 2 x 35 ms per global batch, not 53
    verdict = judge(run(n=2, w1=slow(1.6)))
    assert (verdict.verdict, verdict.worker) == (Straggler.KEPT, "w1")
    assert "1 workers would be slower" in verdict.reason
    # four workers, one 1.5x: 50 ms against 4/3 x 35 = 46.7 ms, under the 10% an eviction must bring
    verdict = judge(run(w3=slow(1.5)))
    assert verdict.verdict is Straggler.KEPT and "less than 10% faster" in verdict.reason


def test_never_below_min_workers():
    verdict = judge(run(w3=slow(3)), min_workers=4)
    assert verdict.verdict is Straggler.KEPT and "min_workers=4" in verdict.reason
    assert judge(run(w3=slow(3)), min_workers=3).verdict is Straggler.EVICT


def test_with_eviction_off_the_straggler_is_reported_only():
    verdict = judge(run(w3=slow(3)), evict=False)
    assert (verdict.verdict, verdict.worker) == (Straggler.REPORTED, "w3")
    assert "eviction is off" in verdict.reason


def test_only_the_current_generations_intervals_count():
    # w3 was slow in generation 1; after a reset its window starts again, and the new ring is healthy
    before = run(w3=slow(3))
    after = {w: ss + summaries([HEALTHY] * 3, generation=2) for w, ss in before.items()}
    verdict = judge_stragglers(after, generation=2, min_workers=1)
    assert verdict.verdict is Straggler.NONE and "3 of 10 intervals" in verdict.reason
    after = {w: ss + summaries([HEALTHY] * WINDOW, generation=2) for w, ss in before.items()}
    assert judge_stragglers(after, generation=2, min_workers=1).verdict is Straggler.NONE


def test_the_slowest_of_two_stragglers_goes_first():
    verdict = judge(run(n=6, w1=slow(2), w4=slow(4)))
    assert verdict.worker == "w4"


def test_probation_a_second_eviction_doubles_the_cool_down():
    probation = Probation(10.0, 300.0)
    seconds, text = probation.evicted("nodeA", now=0.0)
    assert seconds == 10.0 and "on probation" in text
    assert probation.cooling(5.0) == {"nodeA"}
    assert probation.cooling(10.5) == set()  # re-admitted after its cool-down
    seconds, text = probation.evicted("nodeA", now=40.0)  # slow again within probation
    assert seconds == 20.0 and "doubled" in text
    assert probation.cooling(59.0) == {"nodeA"}
    # a host that kept pace for max_s after its re-admission starts over
    probation.forget(now=60.0 + 301.0)
    assert probation.evicted("nodeA", now=400.0)[0] == 10.0


def test_a_straggler_slow_inside_the_collectives_is_judged_against_the_healthy_rings_communication():
    # a CPU-starved rank is slow in the ring too: it waits 8 ms per step, the others 9.6 ms, for steps of 10 ms
    # where compute is 0.7 ms (a small model); the healthy ring communicated 2 ms per step
    straggler = [(0.0018, 0.008)] * WINDOW
    others = [(0.0007, 0.0096)] * WINDOW
    paces = {"w0": summaries(others), "w1": summaries(others), "w2": summaries(others), "w3": summaries(straggler)}
    kept = judge(paces)
    assert kept.verdict is Straggler.KEPT and "not measured healthy" in kept.reason  # its own wait stands in
    evicted = judge_stragglers(paces, generation=1, min_workers=1, healthy_comm=0.002)
    assert evicted.verdict is Straggler.EVICT and "measured while no rank straggled" in evicted.reason
    assert evicted.speedup == pytest.approx(0.0098 / (4 / 3 * 0.0027), rel=0.02)


def patterned(extra: float, others_step: float | None = None) -> dict[str, list[PaceSummary]]:
    """Four ranks; w0 does `extra` seconds of its own work every 10 steps (its median step is healthy).

    The others wait for it: `others_step` is their step (compute and waiting), by default what w0's extra work
    costs them on average.
    """
    steps = 40
    w0 = [PaceSummary(1, 0.0, 1.5, steps, steps * HEALTHY[0] + 4 * extra, steps * HEALTHY[1], HEALTHY[0])] * WINDOW
    step = others_step if others_step is not None else HEALTHY[0] + HEALTHY[1] + 4 * extra / steps
    wait = step - HEALTHY[0]
    other = [PaceSummary(1, 0.0, 1.5, steps, steps * HEALTHY[0], steps * wait, HEALTHY[0])] * WINDOW
    return {"w0": w0, "w1": list(other), "w2": list(other), "w3": list(other)}


def test_extra_work_in_a_steady_pattern_is_reported_not_evicted():
    # every 10 steps w0 evaluates for 0.17 s: its mean compute is 1.57x the others' (3 workers would be 11% faster),
    # its median step theirs; the others step 1.49x as long as in a healthy ring
    verdict = judge_stragglers(patterned(0.17), generation=1, min_workers=1, healthy_comm=HEALTHY[1])
    assert (verdict.verdict, verdict.worker) == (Straggler.KEPT, "w0")
    assert "steady pattern" in verdict.reason and "not under 1/1.5 for the whole window" in verdict.reason


def test_extra_work_that_holds_the_others_under_two_thirds_of_their_pace_for_the_whole_window_is_evicted():
    # 0.3 s every 10 steps: the others step 1.86x as long as a healthy ring, in every interval
    verdict = judge_stragglers(patterned(0.3), generation=1, min_workers=1, healthy_comm=HEALTHY[1])
    assert (verdict.verdict, verdict.worker) == (Straggler.EVICT, "w0")
    # the same extra work while the others keep more than 1/1.5 of their pace in one interval: kept
    paces = patterned(0.3)
    for w in ("w1", "w2", "w3"):
        paces[w][4] = PaceSummary(1, 0.0, 1.5, 40, 40 * HEALTHY[0], 40 * HEALTHY[1], HEALTHY[0])
    assert judge_stragglers(paces, generation=1, min_workers=1, healthy_comm=HEALTHY[1]).verdict is Straggler.KEPT


def test_per_worker_on_a_shared_node_and_per_node_when_all_of_it_is_slow():
    hosts = {f"w{i}": "A" if i < 4 else "B" for i in range(8)}
    one = judge_stragglers(run(n=8, w5=slow(3)), generation=1, min_workers=1, hosts=hosts)
    assert (one.verdict, one.workers, one.node) == (Straggler.EVICT, ("w5",), None)
    node = run(n=8, **{f"w{i}": slow(3) for i in range(4, 8)})
    whole = judge_stragglers(node, generation=1, min_workers=1, hosts=hosts)
    assert whole.verdict is Straggler.EVICT and set(whole.workers) == {"w4", "w5", "w6", "w7"} and whole.node == "B"
    assert "8/4 x" in whole.reason  # the prediction counts every worker that would leave
    kept = judge_stragglers(node, generation=1, min_workers=5, hosts=hosts)
    assert kept.verdict is Straggler.KEPT and "4 workers would be fewer than min_workers=5" in kept.reason
