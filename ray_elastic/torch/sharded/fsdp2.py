"""FSDP2's private surface, in one place: find a model's sharded parameters, and move them to a new world's mesh.

`fully_shard` binds every parameter to the `DeviceMesh` it was called on:
each `FSDPParam` keeps the mesh, its rank's rows (padded to the same size on
every rank, `_sharded_param_data`) and the sharded `DTensor` the module and
the optimizer hold. torch has no public call that moves a sharded module to
another mesh, so after a membership change `rebind` does what `fully_shard`
did at its start, for the new world: the same `DTensor` object (the
optimizer's references stay valid) gets the new rank's rows and the new
mesh's spec, and the `FSDPParam` its new sizes and padded buffer. The
module's hooks, its mixed-precision and offload policies, and its
`reshard_after_forward` stay as the user set them.

Supported: FSDP2 on a one-dimensional mesh over the whole world, every
parameter sharded on dim 0 (the documented `fully_shard` per block and on
the root). `refusal` names what is not: FSDP1, 2-D meshes (HSDP, tensor
parallel), a mesh not over the current world, other placements. Every
private name this module reads is listed in `PRIVATE_NAMES` and checked by
a test against the installed torch, so an upgrade fails there first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor, Shard

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# (owner, attribute) of every private name below, for the test that keeps them honest; `_shard_mesh` and
# `_spmd_mesh`, which torch 2.13 caches and 2.11 does not have, are set only where they exist
PRIVATE_NAMES = (
    ("FSDPModule", "_get_fsdp_state"),
    ("FSDPParam", "_module_info"),
    ("FSDPParam", "mesh_info"),
    ("FSDPParam", "post_forward_mesh_info"),
    ("FSDPParam", "_sharding_spec"),
    ("FSDPParam", "sharded_size"),
    ("FSDPParam", "contiguous_sharded_stride"),
    ("FSDPParam", "padded_sharded_param_size"),
    ("FSDPParam", "_sharded_param_data"),
    ("FSDPParam", "sharded_param"),
    ("FSDPParam", "all_gather_outputs"),
    ("FSDPParam", "fsdp_placement"),
    ("FSDPParam", "is_dtensor"),
    ("FSDPParam", "to_sharded"),
    ("FSDPParamGroup", "fsdp_params"),
    ("FSDPParamGroup", "mesh_info"),
    ("FSDPParamGroup", "post_forward_mesh_info"),
    ("DTensor", "_local_tensor"),
    ("DTensor", "_spec"),
)


class ShardingRefused(ValueError):  # noqa: N818 - a refusal, named for what the user reads
    """A sharded model this library cannot reshard elastically, named with what to use instead."""


def fsdp_modules(model: torch.nn.Module) -> list[Any]:
    """The modules of `model` that `fully_shard` wrapped, in `model.modules()` order."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model: Any) -> bool:
    """Whether `model` holds FSDP-sharded parameters (FSDP2, FSDP1, or `DTensor`s of its own)."""
    if not isinstance(model, torch.nn.Module):
        return False
    if fsdp_modules(model) or _fsdp1(model):
        return True
    return any(isinstance(p, DTensor) for p in model.parameters())


def _fsdp1(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def _param_groups(module: Any) -> list[Any]:
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch before per-parameter meshes: one group or none
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


def fsdp_params(model: torch.nn.Module) -> list[Any]:
    """Every `FSDPParam` of `model`, in one order on every rank (module order, then parameter order)."""
    return [p for m in fsdp_modules(model) for g in _param_groups(m) for p in g.fsdp_params]


def refusal(model: torch.nn.Module, world: int) -> str | None:
    """Why `model`'s sharding cannot be resharded elastically at `world` ranks, or None."""
    if _fsdp1(model):
        return (
            "FSDP1 (FullyShardedDataParallel) is not supported: shard the model with FSDP2, "
            "`torch.distributed.fsdp.fully_shard` on each block and on the root"
        )
    managed = {id(p.sharded_param) for p in fsdp_params(model)}
    for name, param in model.named_parameters():
        if isinstance(param, DTensor) and id(param) not in managed:
            return f"parameter {name!r} is a DTensor that fully_shard does not manage (tensor parallel?): unsupported"
    for module in fsdp_modules(model):
        if len(_param_groups(module)) > 1:
            return f"{type(module).__name__} has several parameter groups (per-parameter meshes): not supported"
    for fsdp_param in fsdp_params(model):
        name = fsdp_param._module_info.param_name
        mesh = fsdp_param.mesh_info.mesh
        if mesh.ndim != 1:
            return (
                f"parameter {name!r} is sharded over a {mesh.ndim}-D mesh (HSDP or tensor parallel): only a "
                "one-dimensional mesh over the whole world is supported "
                "(`init_device_mesh(device_type, (world_size,))`)"
            )
        if mesh.size() != world:
            return f"parameter {name!r} is sharded over a mesh of {mesh.size()} ranks, but the world has {world}"
        if fsdp_param.is_dtensor:
            return f"parameter {name!r} was a DTensor before fully_shard (tensor parallel): not supported"
        if fsdp_param.fsdp_placement != Shard(0):
            return f"parameter {name!r} is sharded as {fsdp_param.fsdp_placement}: only Shard(0) is supported"
        post = fsdp_param.post_forward_mesh_info
        if post is not None and post.mesh is not mesh:
            return (
                f"parameter {name!r} reshards after forward to a smaller group "
                "(reshard_after_forward=<int>): only True or False are supported"
            )
    return None


def mesh_size(model: torch.nn.Module) -> int:
    """The number of ranks `model`'s first sharded parameter is sharded over (1 when none is)."""
    params = fsdp_params(model)
    return params[0].mesh_info.mesh.size() if params else 1


def rows_per_rank(n: int, world: int) -> int:
    """The rows every rank's padded buffer holds (torch's `chunk` size)."""
    return -(-n // world) if n else 0


def rebind(fsdp_param: Any, mesh: DeviceMesh, local: torch.Tensor) -> None:
    """Make `fsdp_param` this rank's shard over `mesh`, holding `local` (its rows, unpadded, on its device).

    The `DTensor` parameter object stays the same; its gradient is dropped
    (a rollback or a reset starts a fresh step).
    """
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    fsdp_param.to_sharded()  # a failure mid-forward can leave it unsharded
    old_spec = fsdp_param._sharding_spec
    global_size = old_spec.tensor_meta.shape
    world, rank = mesh.size(), mesh.get_local_rank()
    per = rows_per_rank(global_size[0], world)
    start = min(rank * per, global_size[0])
    rows = min(start + per, global_size[0]) - start
    if tuple(local.shape) != (rows, *global_size[1:]):
        raise ValueError(f"rank {rank} of {world} holds {rows} rows of {tuple(global_size)}, got {tuple(local.shape)}")
    had_post_forward = fsdp_param.post_forward_mesh_info is not None
    mesh_info = FSDPMeshInfo(mesh, shard_mesh_dim=0)
    fsdp_param.mesh_info = mesh_info
    fsdp_param.post_forward_mesh_info = mesh_info if had_post_forward else None
    for cached in ("_shard_mesh", "_spmd_mesh"):
        if hasattr(fsdp_param, cached):
            setattr(fsdp_param, cached, mesh)
    spec = DTensorSpec(mesh, (Shard(0),), tensor_meta=old_spec.tensor_meta)
    fsdp_param._sharding_spec = spec
    sharded_size = torch.Size((rows, *global_size[1:]))
    fsdp_param.sharded_size = sharded_size
    fsdp_param.contiguous_sharded_stride = torch._prims_common.make_contiguous_strides_for(sharded_size)
    padded_size = torch.Size((per, *global_size[1:]))
    fsdp_param.padded_sharded_param_size = padded_size
    if had_post_forward:
        fsdp_param.sharded_post_forward_size = sharded_size
        fsdp_param.contiguous_sharded_post_forward_stride = fsdp_param.contiguous_sharded_stride
    param = fsdp_param.sharded_param
    old_local = param._local_tensor
    padded = torch.zeros(padded_size, dtype=old_local.dtype, device=old_local.device)
    if getattr(fsdp_param, "pin_memory", False):
        padded = padded.pin_memory()
    padded[:rows].copy_(local)
    fsdp_param._sharded_param_data = padded.view(-1)
    param._local_tensor = padded.narrow(0, 0, rows)
    param._spec = spec
    param.grad = None
    fsdp_param.all_gather_outputs = []  # sized for the old world; the next all-gather allocates them again
    if hasattr(fsdp_param, "_unsharded_param"):
        del fsdp_param._unsharded_param  # a view of the old outputs
    fsdp_param.sharded_state = type(fsdp_param.sharded_state).SHARDED


def rebind_groups(model: torch.nn.Module, mesh: DeviceMesh) -> None:
    """Point every parameter group of `model` at `mesh` and clear what a broken step left in flight."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, TrainingState

    mesh_info = FSDPMeshInfo(mesh, shard_mesh_dim=0)
    for module in fsdp_modules(model):
        state = module._get_fsdp_state()
        for group in _param_groups(module):
            group.mesh_info = mesh_info
            if group.post_forward_mesh_info is not None:
                group.post_forward_mesh_info = mesh_info
            group._training_state = TrainingState.IDLE
            group._sharded_state = type(group._sharded_state).SHARDED
            group._all_gather_result = None
            group._post_reduce_event = None
            group._all_reduce_state = None
            group._partial_reduce_output = None
        ctx = getattr(state, "_state_ctx", None)
        if ctx is not None:
            ctx.iter_forward_root = None
        comm = getattr(state, "_comm_ctx", None)
        if comm is not None:
            comm.all_gather_state = None
            comm.reduce_scatter_state = None
            if hasattr(comm, "reduce_scatter_states"):
                comm.reduce_scatter_states = []
            comm.post_forward_order = []
