"""One process of an FSDP2 run on real Gloo rings (no Ray) whose world changes: `TorchState` reshards it in place.

Run as `python reshard_ranks.py PROCESS OUT_DIR [VARIANT]`; each generation's ring meets in a file there. VARIANT
"fully_shard" (the default) shards the model by hand with default options,
the head left to the root (whose own parameters then come first in FSDP's
order, not in the optimizer's);
"prepared" through `prepare_model(parallel_strategy="fsdp")` with bf16 mixed
precision, `reshard_after_forward=False`, and a loop that clips the DTensor
gradients under a `GradScaler` (in the state, as users hold it), rolled
back as the run loop does (`restore_before_sync`: the rows wait for the sync). The schedule
(`WORLDS`) lists each generation's processes in rank order, as the driver
would assign them (survivors first, hosts contiguous); a process not in a
generation has died (it leaves for good), one that first appears in a
generation is a newcomer: it builds and shards its own model, with other
weights, on that generation's ring. Two hosts are simulated, so replicas go
across hosts.

Every generation, every member: syncs (the reshard), records a digest of the
full state gathered right after it (`get_model_state_dict` / `get_optimizer_
state_dict` with `full_state_dict`: all-gathers of the shards, so bytes,
never arithmetic), trains two steps, commits (but in `UNCOMMITTED`
generations), records the commit's digest, trains one more step (lost to the
next reset), and rolls back, as a survivor of a failure does. A process writes its records as JSON lines into
OUT_DIR/PROCESS.jsonl; the test compares each generation's digest after the
sync with the previous generation's commit.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
from ring_runtime import RingRuntime, file_store
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard

# each generation's processes, in rank order; a host per process
WORLDS = [
    [0, 1, 2, 3],  # the first generation: 4 ranks on hosts A A B B
    [0, 1, 2],  # 4 -> 3: process 3 lost (its replica is on process 1, host A)
    [0, 1, 2, 4],  # 3 -> 4: a newcomer, on host B; this generation fails before it commits
    [0, 1],  # 4 -> 2: host B lost with both its processes (2 and 4): from the buffers of generation 2's world
    [0],  # 2 -> 1
    [0, 5],  # 1 -> 2: a newcomer
]
UNCOMMITTED = {3}  # generations that fail before their first commit
HOSTS = {0: "A", 1: "A", 2: "B", 3: "B", 4: "B", 5: "B"}
FULL = StateDictOptions(full_state_dict=True)


def build_plain() -> torch.nn.Module:
    """The model, unsharded."""
    return torch.nn.Sequential(
        torch.nn.Linear(13, 11), torch.nn.ReLU(), torch.nn.Linear(11, 7), torch.nn.ReLU(), torch.nn.Linear(7, 1)
    )


def build(seed: int, variant: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(seed)
    model = build_plain()
    if variant == "prepared":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from ray_elastic.torch import prepare_model

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        options = {"mp_policy": policy, "reshard_after_forward": False}
        model = prepare_model(model, parallel_strategy="fsdp", parallel_strategy_kwargs=options)
    else:
        for layer in list(model)[:-1]:  # the head stays with the root: a root that holds parameters of its own
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def digest(model, opt) -> str:
    h = hashlib.sha256()
    for name, t in sorted(get_model_state_dict(model, options=FULL).items()):
        h.update(name.encode() + t.detach().reshape(-1).view(torch.uint8).numpy().tobytes())
    optim = get_optimizer_state_dict(model, opt, options=FULL)
    for name, values in sorted(optim["state"].items()):
        for key, t in sorted(values.items()):
            h.update(f"{name}.{key}".encode() + t.detach().reshape(-1).view(torch.uint8).numpy().tobytes())
    h.update(repr([g["lr"] for g in opt.param_groups]).encode())
    return h.hexdigest()


def train_step(model, opt, sched, scaler, generation: int, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * generation + step)
    x = torch.randn(8, 13, generator=g)
    opt.zero_grad()
    loss = model(x).float().square().mean()
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        scaler.step(opt)
        scaler.update()
    sched.step()


def main(process: int, out_dir: str, variant: str) -> None:
    from ray_elastic.collective.torch_gloo import TorchGlooGroup
    from ray_elastic.runtime.process import set_current
    from ray_elastic.torch.state import TorchState

    torch.set_num_threads(1)
    runtime = RingRuntime(host=HOSTS[process])
    set_current(runtime)
    state = None
    with open(os.path.join(out_dir, f"{process}.jsonl"), "w") as out:
        for generation, members in enumerate(WORLDS, start=1):
            if process not in members:
                if state is not None:
                    break  # this process died: it never comes back
                continue
            rank, world = members.index(process), len(members)
            store = file_store(os.path.join(out_dir, f"ring-{generation}.store"), world)
            runtime.group = TorchGlooGroup(store, rank, world, timeout=60)
            if state is None:  # a newcomer (or the first generation): its own model, sharded on this ring
                model, opt, sched = build(0 if generation == 1 else 50 + process, variant)
                scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if variant == "prepared" else None
                extra = {} if scaler is None else {"scaler": scaler}
                state = TorchState(model=model, optimizer=opt, scheduler=sched, step=0, **extra)
            state.sync()
            plan = state._handlers["model"].last_plan
            record = {
                "generation": generation,
                "process": process,
                "rank": rank,
                "after_sync": digest(model, opt),
                "moved": plan.bytes_moved if plan else 0,
                "minimum": plan.minimum_bytes if plan else 0,
                "received": sum(p.nbytes for p in plan.receives(rank)) if plan else 0,
                "same_objects": state.model is model and state.optimizer is opt and state.scheduler is sched,
            }
            for step in range(2):
                train_step(model, opt, sched, scaler, generation, step)
            state.step = state.step + 2
            if generation not in UNCOMMITTED:
                state.commit()
                record["committed"] = digest(model, opt)
                record["step"] = state.step
            train_step(model, opt, sched, scaler, generation, 9)  # lost: the next generation rolls back
            state.check_host_updates()
            state.step = state.step + 1
            out.write(json.dumps(record) + "\n")
            out.flush()
            if variant == "prepared":
                state.restore_before_sync()  # as the run loop rolls back: the next sync's reshard sets the rows
            else:
                state.restore()
                restored = {"generation": generation, "process": process, "restored": digest(model, opt)}
                out.write(json.dumps(restored) + "\n")
                out.flush()
            dist.barrier()
            runtime.group.close()
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "fully_shard")
