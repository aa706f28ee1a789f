"""`ShardedHandler`: an FSDP2 model and its optimizers in a `TorchState`, committed shard by shard.

A sharded model has no rank that holds all of it, so the commit, the
rollback and the sync of `module_handler.py` (rank 0's copy to the others)
do not apply. Here:

- A commit copies this rank's rows of every sharded tensor (the parameters
  and the optimizers' `DTensor` moments) into one flat host buffer, with the
  optimizers' plain values (AdamW's `step`) and hyper-parameters; then every
  rank sends its buffer to its replica holder (`replica_holder`: a rank on
  another host) and keeps its ward's, so one host's loss loses no
  committed row, within the commit (see `replicate` for why not beside the
  next step). Host memory: its own shard and one replica.
- A rollback copies the buffer back into the live tensors; the optimizers
  keep their objects and the parameters their identity. Between a reshard
  and the next commit the buffers are the old world's: a rollback then
  leaves the live tensors to the sync that follows it, which reshards them
  from those buffers again.
- A sync after a reset (`reshard`, every rank at once): the ranks say which
  committed shards they hold; `plan_reshard` gives every run of rows of the
  new layout one live source (the rank itself, else the owner, else the
  replica); only those rows move, point to point; then every sharded module
  is moved onto the new world's mesh (`fsdp2.rebind`), the optimizers'
  moments become `DTensor`s of that mesh. The old world's buffers keep
  holding the commit (a second failure before the next commit reshards from
  them again); the next commit saves the new layout with its replicas, so
  the recovery does not wait for that copy and exchange. Newcomers, whose
  `train_fn` built and sharded the model on the new world, receive exactly
  their rows.

The flat layout of the rows and their movement by a plan are `rows.py`'s.

A commit cut short by a failure (a rank died between its copy and the
replica exchange), or a shard lost with its replica, leaves rows with no
holder of the commit rank 0 holds: `reshard` then raises `ShardLostError`,
naming them, and `TorchState` goes back to the newest durable checkpoint
(`write_durable`, DCP's format) where there is one.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor, Shard

from ray_elastic.state.reshard_plan import ReshardPlan, plan_reshard, replica_holder, wards_of
from ray_elastic.torch.handler import StateHandler
from ray_elastic.torch.sharded import dcp_files, fsdp2
from ray_elastic.torch.sharded.rows import (
    Key,
    Layout,
    Shard_,
    as_bytes,
    held_as,
    move_rows,
    rows_of_layout,
)

if TYPE_CHECKING:
    from ray_elastic.collective.base import CollectiveGroup
    from ray_elastic.runtime.context import WorkerContext

logger = logging.getLogger(__name__)


def _host(worker: WorkerContext | None) -> str:
    """This worker's host in its generation, where a shard's replica must not go ("local" outside a worker)."""
    now = None if worker is None else worker.generation_now()
    slot = None if now is None else now.slot
    return "local" if slot is None else slot.host


class ShardedHandler(StateHandler):
    """An FSDP2-sharded model with the optimizers that step it: committed, rolled back and resharded by shards.

    `worker` (its `TorchState`'s runtime; None outside a worker) says which
    host this rank is on, so a replica goes to another host.
    """

    def __init__(self, model: torch.nn.Module, optimizers: list[Any], worker: WorkerContext | None = None) -> None:
        super().__init__(model)
        self.optimizers = optimizers
        self._worker = worker
        self.initial = True  # no sync yet: every rank's own shard is the state the run starts from
        self._own: Shard_ | None = None
        self._replicas: list[Shard_] = []
        self._plain: dict[Key, Any] = {}
        self._hyper: list[list[dict[str, Any]]] = []
        self.last_plan: ReshardPlan | None = None
        self._durable: str | None = None  # the DCP directory of the newest durable commit
        self._resume: str | None = None  # on rank 0: a DCP directory the next reshard loads instead
        self.last_reshard_s = 0.0
        self._hosts: tuple[CollectiveGroup, list[str]] | None = None  # the ring's hosts, asked once per ring

    # ---- the live tensors ---------------------------------------------------------------
    def _params(self) -> list[Any]:
        return [fp.sharded_param for fp in fsdp2.fsdp_params(self.value)]

    def _optimizer_of(self, param: Any) -> Any:
        for opt in self.optimizers:
            if any(p is param for g in opt.param_groups for p in g["params"]):
                return opt
        return None

    def layout(self) -> Layout:
        keys: list[Key] = []
        shapes: list[tuple[int, ...]] = []
        dtypes: list[torch.dtype] = []
        for i, param in enumerate(self._params()):
            keys.append((i, None))
            shapes.append(tuple(param.shape))
            dtypes.append(param.dtype)
            opt = self._optimizer_of(param)
            state = {} if opt is None else opt.state.get(param, {})
            for key in sorted(state):
                if isinstance(state[key], DTensor):
                    keys.append((i, key))
                    shapes.append(tuple(state[key].shape))
                    dtypes.append(state[key].dtype)
        return Layout(tuple(keys), tuple(shapes), tuple(dtypes))

    def _live(self, layout: Layout) -> list[torch.Tensor]:
        params = self._params()
        out = []
        for i, key in layout.keys:
            param = params[i]
            t = param if key is None else self._optimizer_of(param).state[param][key]
            out.append(t._local_tensor)
        return out

    def _plain_values(self) -> dict[Key, Any]:
        values: dict[Key, Any] = {}
        for i, param in enumerate(self._params()):
            opt = self._optimizer_of(param)
            for key, value in ({} if opt is None else opt.state.get(param, {})).items():
                if not isinstance(value, DTensor):
                    values[(i, key)] = value.detach().clone() if isinstance(value, torch.Tensor) else value
        return values

    def _hyper_values(self) -> list[list[dict[str, Any]]]:
        return [
            [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in o.param_groups]
            for o in self.optimizers
        ]

    # ---- commit and rollback ----------------------------------------------------------------
    def save(self) -> None:
        layout = self.layout()
        live = self._live(layout)
        world, rank = self._world_rank()
        total = sum(t.numel() * t.element_size() for t in live)
        own = self._own
        if own is None or own.flat.numel() != total or (own.world, own.rank) != (world, rank):
            own = Shard_(world, rank, 0, torch.empty(total, dtype=torch.uint8))
        own.stamp = 0  # torn until the copy is whole
        for (at, nbytes), t in zip(layout.offsets(world, rank), live, strict=True):
            own.flat[at : at + nbytes].copy_(as_bytes(t))
        self._own = own
        self._layout = layout
        self._plain = self._plain_values()
        self._hyper = self._hyper_values()

    def committed(self, stamp: int) -> None:
        """TorchState's commit `stamp` is whole on this rank."""
        if self._own is not None:
            self._own.stamp = stamp

    def _world_rank(self) -> tuple[int, int]:
        fps = fsdp2.fsdp_params(self.value)
        if not fps:
            return 1, 0
        mesh = fps[0].mesh_info.mesh
        return mesh.size(), mesh.get_local_rank()

    def restore(self, rows: bool = True) -> None:
        """Back to the commit; `rows=False` leaves the sharded rows to the reshard that follows (it sets them all)."""
        own = self._own
        if own is None:
            return
        params = self._params()
        if not rows:
            for p in params:
                p.grad = None
            return
        layout = self.layout()
        if layout.keys != self._layout.keys or self._world_rank() != (own.world, own.rank):
            return  # the live tensors are another world's (a reshard was cut short): the next reshard sets them
        for (at, nbytes), t in zip(layout.offsets(own.world, own.rank), self._live(layout), strict=True):
            as_bytes(t).copy_(own.flat[at : at + nbytes])
        for (i, key), value in self._plain.items():
            state = self._optimizer_of(params[i]).state[params[i]]
            if isinstance(value, torch.Tensor):
                state[key].copy_(value)
            else:
                state[key] = value
        self._apply_hyper(self._hyper)
        for p in params:
            p.grad = None

    def _apply_hyper(self, hyper: list[list[dict[str, Any]]]) -> None:
        for opt, groups in zip(self.optimizers, hyper, strict=True):
            for group, values in zip(opt.param_groups, groups, strict=True):
                group.update(copy.deepcopy(values))

    # ---- durable checkpoints: DCP's format, every rank its own files ----------------------------
    def write_durable(self, directory: str) -> None:
        """Write the commit (the live state: called right after it) in DCP's format: every rank calls it."""
        dcp_files.save(self.value, self.optimizers, directory)
        self._durable = directory

    def snapshot(self) -> dict[str, Any]:
        """For rank 0's checkpoint entries: where the shards of this commit were written (`write_durable`)."""
        if self._durable is None:
            raise RuntimeError("a sharded model's durable checkpoint is written by write_durable() on every rank first")
        return {"dcp": self._durable}

    def load_snapshot(self, snapshot: Any) -> None:
        """On rank 0, resuming: the next reshard loads `snapshot`'s DCP files on every rank instead."""
        if not isinstance(snapshot, dict) or "dcp" not in snapshot:
            raise ValueError("the checkpoint holds no sharded model (it was written from an unsharded one)")
        self._resume = snapshot["dcp"]

    # ---- replicas -----------------------------------------------------------------------------
    def replicate(self, ring: CollectiveGroup) -> None:
        """Send this rank's committed shard to its replica holder; keep its wards' (every rank calls it).

        Synchronous, inside the commit: left in flight beside the next step,
        a rank lost in that step would take its commit's rows with it (its
        replica not yet whole, and the previous commit overwritten), unless
        every buffer were kept twice.
        """
        own = self._own
        if own is None or ring.size < 2:
            self._replicas = []
            return
        if self._hosts is None or self._hosts[0] is not ring:
            self._hosts = (ring, ring.allgather_object(_host(self._worker)))
        hosts = self._hosts[1]
        holder = replica_holder(ring.rank, hosts)
        # a buffer whose exchange was cut short is not written again: a dead ring's late bytes must land nowhere
        kept = {(r.world, r.rank): r for r in self._replicas if r.stamp}
        replicas = []
        for ward in wards_of(ring.rank, hosts):
            nbytes = sum(n for _, n in self._layout.offsets(ring.size, ward))
            replica = kept.get((ring.size, ward))
            if replica is None or replica.flat.numel() != nbytes:
                replica = Shard_(ring.size, ward, 0, torch.empty(nbytes, dtype=torch.uint8))
            replica.stamp = 0  # torn until received
            replicas.append(replica)
        self._replicas = replicas
        assert holder is not None
        works = [ring.send_async(own.flat, holder)] + [ring.recv_async(r.flat, r.rank) for r in replicas]
        for w in works:
            w.wait()
        for replica in replicas:
            replica.stamp = own.stamp

    # ---- the sync: reshard to the new world ---------------------------------------------------
    def describe(self) -> Any:
        return self._layout, self._plain, self._hyper, self._state_order(), self._resume

    def _sharding(self) -> list[tuple[str, tuple[int, ...], str]]:
        """Each sharded parameter's module, global shape and dtype, in FSDP's order: alike on every rank."""
        return [
            (
                type(fp._module_info.module).__name__ + "." + fp._module_info.param_name,
                tuple(fp.sharded_param.shape),
                str(fp.sharded_param.dtype),
            )
            for fp in fsdp2.fsdp_params(self.value)
        ]

    def _state_order(self) -> list[list[tuple[int, list[str]]]]:
        """Each optimizer's state, as (parameter number, its keys) in the order the dicts hold them.

        torch's state-dict helpers gather a sharded optimizer's moments in
        that order: every rank must hold it alike, or their collectives pair
        up wrongly (a newcomer's state is built here, a survivor's by its steps).
        """
        number = {id(p): i for i, p in enumerate(self._params())}
        return [[(number[id(p)], list(state)) for p, state in opt.state.items()] for opt in self.optimizers]

    def reshard(self, ring: CollectiveGroup, commit: int) -> None:
        """Give every rank of the ring its rows of rank 0's commit, and move the model onto the ring's mesh.

        `commit`: the fingerprint of the commit this rank's `TorchState`
        holds (rank 0's is the one every rank resumes from).
        """
        started = time.perf_counter()
        mine = {
            "initial": self.initial,
            "sharding": self._sharding(),
            "commit": commit,
            "own": held_as(self._own),
            "replicas": [held_as(r) for r in self._replicas],
        }
        holdings = ring.allgather_object(mine)
        differ = [r for r, h in enumerate(holdings) if h["sharding"] != holdings[0]["sharding"]]
        if differ:
            raise fsdp2.ShardingRefused(
                f"ranks {differ} shard the model differently from rank 0 (other modules wrapped by fully_shard, or "
                f"other parameters): every rank must build and shard the same model; rank 0: "
                f"{holdings[0]['sharding'][:4]}..., rank {differ[0]}: {holdings[differ[0]]['sharding'][:4]}..."
            )
        layout, plain, hyper, order, resume = ring.broadcast_object(
            self.describe() if ring.rank == 0 else None, root_rank=0
        )
        root = holdings[0]
        if resume is not None:
            # onto this ring's mesh first (a survivor's model is still on the old one), then DCP fills the rows
            self._rebind(ring, layout, rows_of_layout(layout, ring.size, ring.rank), plain)
            self._reorder(order)
            self._resume_from(ring, resume, root["commit"], started)
            return
        if root["initial"]:
            # the run's first sync: every rank's own shard, cut by fully_shard on this world, is the state
            held = {r: {h["own"][1]} for r, h in enumerate(holdings) if h["initial"] and h["own"]}
            old_world = ring.size
        else:
            old_world, stamp = root["own"][0], root["own"][2]
            held = {}
            for r, h in enumerate(holdings):
                held[r] = {s[1] for s in (h["own"], *h["replicas"]) if s is not None and s[2] == stamp}
        owned = {
            r: h["own"][1] for r, h in enumerate(holdings) if h["own"] is not None and h["own"][1] in held.get(r, ())
        }
        plan = plan_reshard(layout.shapes, layout.itemsizes, old_world, ring.size, held, owned)
        fresh = move_rows(ring, layout, plan, self._source)
        self._rebind(ring, layout, fresh, plain)
        self._reorder(order)
        self._apply_hyper(hyper)
        if root["initial"]:  # the run's first commit with replicas
            self.save()
            self.committed(root["commit"])
            self.replicate(ring)
        # else the survivors' buffers (their shards and replicas of the old world) hold this very commit, stamped
        # with it, until the next commit saves the new layout with its replicas: off the recovery's critical path
        self.initial = False
        self.last_plan = plan
        self.last_reshard_s = time.perf_counter() - started
        logger.info(
            "resharded %d -> %d ranks: %.1f MB moved (the minimum), %.3f s",
            old_world,
            ring.size,
            plan.bytes_moved / 1e6,
            self.last_reshard_s,
        )

    def _resume_from(self, ring: CollectiveGroup, directory: str, commit: int, started: float) -> None:
        """Every rank loads the durable checkpoint rank 0 resumed from, resharded to this world by DCP."""
        dcp_files.load(self.value, self.optimizers, directory)
        self._resume = None
        self.initial = False
        self.last_plan = None
        self.save()
        self.committed(commit)
        self.replicate(ring)
        self.last_reshard_s = time.perf_counter() - started
        logger.info("loaded the sharded checkpoint %s on %d ranks in %.3f s", directory, ring.size, self.last_reshard_s)

    def _source(self, owner: int) -> tuple[torch.Tensor, int]:
        """The committed rows of old rank `owner` this rank holds (its own, or a ward's replica), and their world."""
        for shard in (self._own, *self._replicas):
            if shard is not None and shard.rank == owner:
                return shard.flat, shard.world
        raise RuntimeError(f"this rank holds no shard of old rank {owner}")

    def _rebind(self, ring: CollectiveGroup, layout: Layout, fresh: list[torch.Tensor], plain: dict[Key, Any]) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        fps = fsdp2.fsdp_params(self.value)
        device = fps[0].sharded_param._local_tensor.device
        mesh = init_device_mesh(device.type, (ring.size,))
        fsdp2.rebind_groups(self.value, mesh)
        params = [fp.sharded_param for fp in fps]
        for (i, key), shape, local in zip(layout.keys, layout.shapes, fresh, strict=True):
            if key is None:
                fsdp2.rebind(fps[i], mesh, local.to(device))
                continue
            param = params[i]
            state = self._optimizer_of(param).state.setdefault(param, {})
            on = state[key]._local_tensor.device if key in state else device
            state[key] = DTensor.from_local(
                local.to(on), mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=param.stride()
            )
        for (i, key), value in plain.items():
            param = params[i]
            state = self._optimizer_of(param).state.setdefault(param, {})
            held = state.get(key)
            if isinstance(value, torch.Tensor) and isinstance(held, torch.Tensor) and held.shape == value.shape:
                held.copy_(value)  # AdamW's `step` stays the tensor, on the device, the optimizer made
            else:
                state[key] = value.clone() if isinstance(value, torch.Tensor) else value

    def _reorder(self, order: list[list[tuple[int, list[str]]]]) -> None:
        """Hold every optimizer's state in rank 0's order (the same dicts and values, reinserted)."""
        params = self._params()
        for opt, entries in zip(self.optimizers, order, strict=True):
            held = dict(opt.state)
            opt.state.clear()
            for i, keys in entries:
                state = held.pop(params[i])
                opt.state[params[i]] = {key: state[key] for key in keys}
            opt.state.update(held)


class OwnedOptimizer(StateHandler):
    """An optimizer that steps a sharded model: its `ShardedHandler` commits, rolls back and reshards it."""

    def save(self) -> None:
        pass

    def restore(self) -> None:
        pass

    def sync(self) -> None:
        pass

    def snapshot(self) -> None:
        return None

    def load_snapshot(self, snapshot: Any) -> None:
        pass
