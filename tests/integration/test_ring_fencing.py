"""Invariant 7 on a real Gloo ring, without Ray: nothing of an abandoned ring reaches live memory.

torch cannot cancel a Gloo collective; before the ring's connections were
cut on abandon, a survivor's abandoned allreduce completed into its tensor
as soon as the silent member came back, and that member completed a step of
the dead generation (measured on a healed partition, issue 34).
"""

from __future__ import annotations


def test_an_abandoned_ring_never_completes_into_the_survivors_tensors_nor_for_the_cut_off_rank(tmp_path):
    """Every path: the user's allreduce_, an optimizer bucket, the DDP hook's future, a sync's broadcast, a transfer."""
    import torch.multiprocessing as mp
    from fencing_ranks import PATHS, WORLD, rank_main

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, str(tmp_path), out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        found = {r["rank"]: r for r in (out.get(timeout=180) for _ in procs)}
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    for path in PATHS:
        cut_off = found[2]["paths"][path]
        assert cut_off["outcome"].startswith("failed"), f"{path}: the cut-off rank completed the dead ring's collective"
        for rank in (0, 1):
            survivor = found[rank]["paths"][path]
            assert survivor["outcome"].startswith("failed"), (path, survivor)
            assert survivor["abandon_took"] < 1.0, f"{path}: abandon blocked {survivor['abandon_took']:.2f} s"
            assert survivor["untouched"], f"{path}, rank {rank}: the dead ring wrote into the tensor after the abandon"
    for rank in range(WORLD):
        assert found[rank]["late_completions"] == 0, found[rank]
