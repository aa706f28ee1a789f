"""One rank of an FSDP2 run that writes a durable sharded checkpoint, or of a new run that resumes from it (no Ray).

Run as `python durable_shards.py PHASE RANK WORLD DIR`; the rings meet in files in DIR.

- `write`: trains, commits, writes the commit's shards with
  `TorchState.write_shards` (every rank, DCP's format), and rank 0 its
  checkpoint entries (as its checkpoint writer would) into DIR/entries.pt;
  then trains on (lost). Each rank prints the digest of the commit.
- `resume`: a new run of another size, other weights: rank 0 loads the
  entries (as `maybe_resume` does), every rank syncs, and prints the digest
  of what it holds then.
- `mismatch`: rank 1 shards the head on its own where rank 0 leaves it to the
  root; every rank prints the error its first sync raises.
- `lost` (4 processes on hosts A A B B, `checkpoint_dir` DIR/run with a
  durable checkpoint every second commit): three commits, then processes 1
  and 3, which keep each other's replicas, are lost at once; 0 and 2 sync
  as a world of 2. Each prints the digests of the commits and of what it
  holds after the sync, and the reason rank 0 gave the driver.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from reshard_ranks import build, build_plain, digest, train_step
from ring_runtime import RingRuntime, file_store


def model_digest(model: torch.nn.Module) -> str:
    """The full model's bytes, as `tests/integration/test_sharded_reshard.py` computes them from a plain copy."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return full_digest(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))


def full_digest(state_dict: dict[str, torch.Tensor]) -> str:
    import hashlib

    h = hashlib.sha256()
    for name, t in sorted(state_dict.items()):
        h.update(name.encode() + t.detach().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def lost(process: int, directory: str) -> None:
    from types import SimpleNamespace

    from ray_elastic.collective.torch_gloo import TorchGlooGroup
    from ray_elastic.runtime.checkpoint_cadence import CheckpointCadence
    from ray_elastic.runtime.process import set_current
    from ray_elastic.torch.state import TorchState

    told: list[dict] = []
    driver = SimpleNamespace(tell=SimpleNamespace(remote=lambda message: told.append(message.meta)))
    settings = SimpleNamespace(
        checkpoint_dir=os.path.join(directory, "run"),
        checkpoint_keep=2,
        checkpoint_timeout=60.0,
        checkpoint_every=2,
        run_id="r",
    )
    cadence = CheckpointCadence(f"w{process}", driver, settings)
    runtime = RingRuntime(host="AABB"[process], checkpoints=cadence)
    runtime.slot.rank, runtime.slot.size = process, 4
    set_current(runtime)
    store = file_store(os.path.join(directory, "lost-4.store"), 4)
    runtime.group = TorchGlooGroup(store, process, 4, timeout=60)
    model, opt, sched = build(0, "fully_shard")
    state = TorchState(model=model, optimizer=opt, scheduler=sched, step=0)
    state.sync()
    out: dict = {"process": process, "commits": []}
    for commit in (1, 2, 3):
        train_step(model, opt, sched, None, 1, commit)
        state.step = commit
        state.save()
        runtime.after_commit(state, 0.0)
        out["commits"].append(digest(model, opt))
    cadence.flush()
    dist.barrier()
    runtime.group.close()
    if process in (1, 3):
        os._exit(0)  # both lost at once: each held the other's replica
    rank = (0, None, 1)[process]
    store = file_store(os.path.join(directory, "lost-2.store"), 2)
    runtime.group = TorchGlooGroup(store, rank, 2, timeout=60)
    runtime.slot.rank, runtime.slot.size = rank, 2
    state.restore()
    state.sync()
    out.update(
        after=digest(model, opt), step=state.step, commit_count=runtime.commits, told=[m.get("reason") for m in told]
    )
    print(json.dumps(out), flush=True)
    dist.barrier()
    runtime.group.close()
    os._exit(0)


def main(phase: str, rank: int, world: int, directory: str) -> None:
    from ray_elastic.checkpoint.entries import load_entries, state_entries
    from ray_elastic.collective.torch_gloo import TorchGlooGroup
    from ray_elastic.runtime.process import set_current
    from ray_elastic.torch.state import TorchState

    torch.set_num_threads(1)
    runtime = RingRuntime(host="local")
    set_current(runtime)
    store = file_store(os.path.join(directory, f"{phase}.store"), world)
    runtime.group = TorchGlooGroup(store, rank, world, timeout=60)
    model, opt, sched = build(0 if phase == "write" else 77, "fully_shard")
    if phase == "mismatch" and rank == 1:
        from torch.distributed.fsdp import fully_shard

        model = build_plain()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters())
    state = TorchState(model=model, optimizer=opt, scheduler=sched, step=0)
    if phase == "mismatch":
        try:
            state.sync()
            out = {"rank": rank, "error": None}
        except Exception as e:  # noqa: BLE001 - reported to the test
            out = {"rank": rank, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)
        os._exit(0)
    if phase == "write":
        state.sync()
        for step in range(3):
            train_step(model, opt, sched, None, 1, step)
        state.step = 3
        state.save()
        assert state.write_shards(os.path.join(directory, "sharded"))
        if rank == 0:
            torch.save(state_entries(state), os.path.join(directory, "entries.pt"))
        out = {"rank": rank, "digest": digest(model, opt), "step": state.step, "model": model_digest(model)}
        train_step(model, opt, sched, None, 1, 9)  # trained on after the checkpoint: not in it
    else:
        if rank == 0:
            load_entries(state, torch.load(os.path.join(directory, "entries.pt"), weights_only=False))
        state.sync()
        out = {"rank": rank, "digest": digest(model, opt), "step": state.step}
    print(json.dumps(out), flush=True)
    dist.barrier()
    runtime.group.close()
    os._exit(0)


if __name__ == "__main__":
    if sys.argv[1] == "lost":
        lost(int(sys.argv[2]), sys.argv[4])
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
