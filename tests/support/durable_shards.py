"""One rank of an FSDP2 run that writes a durable sharded checkpoint, or of a new run that resumes from it (no Ray).

Run as `python durable_shards.py PHASE RANK WORLD PORT DIR`.

- `write`: trains, commits, writes the commit's shards with
  `TorchState.write_shards` (every rank, DCP's format), and rank 0 its
  checkpoint entries (as its checkpoint writer would) into DIR/entries.pt;
  then trains on (lost). Each rank prints the digest of the commit.
- `resume`: a new run of another size, other weights: rank 0 loads the
  entries (as `maybe_resume` does), every rank syncs, and prints the digest
  of what it holds then.
- `mismatch`: rank 1 shards the head on its own where rank 0 leaves it to the
  root; every rank prints the error its first sync raises.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
from reshard_ranks import build, build_plain, digest, train_step
from ring_runtime import RingRuntime


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


def main(phase: str, rank: int, world: int, port: int, directory: str) -> None:
    from ray_elastic.checkpoint.entries import load_entries, state_entries
    from ray_elastic.collective.torch_gloo import TorchGlooGroup
    from ray_elastic.runtime.process import set_current
    from ray_elastic.torch.state import TorchState

    torch.set_num_threads(1)
    runtime = RingRuntime(host="local")
    set_current(runtime)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60))
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
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
