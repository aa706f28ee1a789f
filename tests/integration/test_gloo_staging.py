"""torch Gloo with values that are not in host memory (GPU tensors), without a GPU and without Ray.

Gloo's send and receive take host memory only: a CUDA tensor's pointer fails
with "writev ... Bad address". So `TorchGlooGroup` stages a non-CPU value
through a host buffer and copies the result back, except a CUDA tensor's
allreduce and broadcast, which torch's Gloo stages itself without a host
wait. Real processes on a real Gloo ring run every collective and transfer
the library makes (the sync's send/recv, buckets' async allreduce,
broadcast, allgather) as they are, with our staging forced on CPU tensors,
and with the tensors taken for CUDA ones: the caller's tensors must end
bitwise the same each time, and only the operations that must go through
our host buffers do. tests/integration/test_gpu.py runs the same paths with
CUDA tensors where a GPU is visible.
"""

from __future__ import annotations

import staging_ranks
import torch
import torch.multiprocessing as mp

from ray_elastic.collective.torch_gloo import stage_on_host


def _run(mode: str, tmp_path) -> list[dict]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    control = tmp_path / mode
    control.mkdir()
    procs = [ctx.Process(target=staging_ranks.run, args=(r, 2, str(control), mode, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        found = [out.get(timeout=90) for _ in range(2)]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return sorted(found, key=lambda f: f["rank"])


def test_staged_collectives_and_transfers_end_bitwise_as_on_the_host(tmp_path):
    plain, staged, cuda = (_run(mode, tmp_path) for mode in ("host", "device", "cuda"))
    assert not any(plain[0]["staged"].values())
    for p, s, c in zip(plain, staged, cuda, strict=True):
        for run, name in ((s, "staged"), (c, "CUDA")):
            differs = [k for k in p if k not in ("staged", "rank") and p[k] != run[k]]
            assert not differs, f"rank {p['rank']}: {name} results differ from the host's in {differs}"
        # a device torch's Gloo cannot stage: every operation went through our host buffers
        assert all(n > 0 for n in s["staged"].values()), s["staged"]
        # CUDA: the allreduces and broadcasts were torch's to stage (no host wait); sends, receives and
        # allgathers still go through ours
        assert c["staged"]["allreduce"] == c["staged"]["allreduce_async"] == c["staged"]["broadcast"] == 0
        assert c["staged"]["send/recv"] > 0 and c["staged"]["allgather"] > 0, c["staged"]
    # the transfer did move rank 0's tensor to rank 1
    assert staged[1]["send/recv f32"] == staged[0]["send/recv f32"]


def test_a_cpu_tensor_is_used_in_place():
    t = torch.ones(3)
    host, back = stage_on_host(t)
    assert host is t and back is None
