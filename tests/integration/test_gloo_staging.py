"""torch Gloo with values that are not in host memory (GPU tensors), without a GPU and without Ray.

Gloo's send and receive take host memory only: a CUDA tensor's pointer fails
with "writev ... Bad address". So `TorchGlooGroup` stages every non-CPU
value through a host buffer and copies the result back. Real processes on
a real Gloo ring run every collective and transfer the library makes (the
sync's send/recv, buckets' async allreduce, broadcast, allgather) once as
they are and once with the staging forced on CPU tensors: the caller's
tensors must end bitwise the same, and the staged run must have gone
through host buffers. tests/integration/test_gpu.py runs the same path with CUDA
tensors where a GPU is visible.
"""

from __future__ import annotations

import staging_ranks
import torch
import torch.multiprocessing as mp

from ray_elastic.collective.torch_gloo import stage_on_host


def _run(staged: bool, tmp_path) -> list[dict]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    control = tmp_path / ("staged" if staged else "plain")
    control.mkdir()
    procs = [ctx.Process(target=staging_ranks.run, args=(r, 2, str(control), staged, out)) for r in range(2)]
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
    plain = _run(False, tmp_path)
    staged = _run(True, tmp_path)
    assert plain[0]["staged buffers"] == 0
    for p, s in zip(plain, staged, strict=True):
        assert s["staged buffers"] > 0 and s["buffers on host"]
        differs = [k for k in p if k not in ("staged buffers", "buffers on host") and p[k] != s[k]]
        assert not differs, f"rank {p['rank']}: staged results differ from the host's in {differs}"
    # the transfer did move rank 0's tensor to rank 1
    assert staged[1]["send/recv f32"] == staged[0]["send/recv f32"]


def test_a_cpu_tensor_is_used_in_place():
    t = torch.ones(3)
    host, back = stage_on_host(t)
    assert host is t and back is None
