"""`OptimizerHandler`: an optimizer's per-parameter state and its param groups' hyper-parameters in a `TorchState`.

The moments and step counts are kept in `TensorBuffers` (traded back on a
restore); a sync sends rank 0's structure first and then its tensors only
to the ranks that lack its commit. A newcomer can allocate and fault in the
state's tensors before it is ready (`layout` / `prepare`). Also
`broadcast_optimizer_state`, Horovod's helper.

Received and resumed state is placed by torch's own rule, the one
`Optimizer.load_state_dict` applies (`placed`): moments on their
parameter's device and dtype, AdamW's `step` left on the host unless the
group is capturable or fused.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch

from ray_elastic.torch.commit_buffers import TensorBuffers
from ray_elastic.torch.handler import StateHandler, _sync_from_rank0
from ray_elastic.torch.heap import faulted_in
from ray_elastic.torch.optimizer import DistributedOptimizer

if TYPE_CHECKING:
    from collections.abc import Sequence


def placed(param: torch.Tensor, value: torch.Tensor, index: int, key: str, group: dict[str, Any]) -> torch.Tensor:
    """`value` where `Optimizer.load_state_dict` would put it as state `key` of parameter number `index`.

    torch's own rule, given the parameter's group (its hyper-parameters): a
    moment takes its parameter's device and floating dtype, a `step` stays
    as it is unless the group is capturable or fused.
    """
    groups = [{**group, "params": [index]}]  # the parameter's own group: torch finds it without a scan of all
    return torch.optim.Optimizer._process_value_according_to_param_policy(param, value, index, groups, key)


def _group_of(optimizer: torch.optim.Optimizer) -> list[int]:
    """The index of each parameter's group, in the optimizer's order of parameters."""
    return [g for g, group in enumerate(optimizer.param_groups) for _ in group["params"]]


def _inner_optimizer(value: Any) -> torch.optim.Optimizer:
    """The optimizer whose step changes the state: the wrapped one inside a `DistributedOptimizer`."""
    return value.optimizer if isinstance(value, DistributedOptimizer) else value


class OptimizerHandler(StateHandler):
    """An optimizer's per-parameter state and its param groups' hyper-parameters."""

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self._buffers = TensorBuffers()
        self._layout: list[tuple[int, str]] = []  # (param index, state key) of each saved tensor
        self._values: dict[tuple[int, str], Any] = {}  # non-tensor state (e.g. a float step)
        self._hyper: list[dict[str, Any]] = []
        self._stepped = False  # a step pre-hook tells this handler before the optimizer changes its state
        self._shapes: tuple[tuple[int, str, tuple[int, ...], torch.dtype], ...] = ()  # the saved tensors' layout
        self._prepared: dict[tuple[int, str], torch.Tensor] = {}  # see prepare

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return _inner_optimizer(self.value)

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _state_items(
        self, ordered: bool = False
    ) -> tuple[list[tuple[int, str]], list[torch.Tensor], dict[tuple[int, str], Any]]:
        """Tensor state (layout and tensors) and the other values: in the optimizer's order, or by key."""
        layout, tensors, values = [], [], {}
        for i, p in enumerate(self._params()):
            items = self.optimizer.state.get(p, {}).items()
            for key, v in sorted(items) if ordered else items:
                if isinstance(v, torch.Tensor):
                    layout.append((i, key))
                    tensors.append(v)
                else:
                    values[(i, key)] = v
        return layout, tensors, values

    def _hyper_params(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def guard(self, stepped: set[int]) -> None:
        self._stepped = True

    def touched(self) -> None:
        self._buffers.touched()

    def save(self) -> None:
        self._save(later=False)

    def keep_live(self) -> None:
        self._save(later=True)

    def _save(self, later: bool) -> None:
        layout, tensors, values = self._state_items()
        if later:
            self._buffers.save_later(tensors, [self._stepped] * len(tensors))
        else:
            self._buffers.save(tensors)
        self._layout = layout
        self._shapes = tuple((i, key, tuple(t.shape), t.dtype) for (i, key), t in zip(layout, tensors, strict=True))
        self._values = copy.deepcopy(values)
        self._hyper = copy.deepcopy(self._hyper_params())

    def layout(self) -> tuple[tuple[int, str, tuple[int, ...], torch.dtype], ...]:
        """(param index, key, shape, dtype) of each tensor of the last commit: what a newcomer will receive."""
        return self._shapes

    def prepare(self, layout: Sequence[tuple[int, str, tuple[int, ...], torch.dtype]]) -> int:
        """Allocate the tensors `layout` names, their pages faulted in, for `receive` to use; returns the bytes.

        A newcomer calls it with rank 0's published layout before it tells
        the driver it is ready, so the first touch of that fresh memory (on a VM about
        as costly as receiving its bytes) is off the sync's path. Kept apart
        from the optimizer's state until `receive` takes them: an optimizer
        that ends up receiving nothing is left as it was. The buffers of the
        commit the newcomer makes of what it received are allocated and
        faulted in too: their first touch would otherwise fall in its first
        training step, while the survivors wait on its gradients.
        """
        params = self._params()
        if any(i >= len(params) or params[i].device.type != "cpu" for i, _, _, _ in layout):
            return 0  # not this optimizer's layout, or state on a GPU: nothing to gain on the host
        made = []
        for i, key, shape, dtype in layout:
            self._prepared[(i, key)] = faulted_in(shape, dtype)
            made.append(self._prepared[(i, key)])
        self._buffers.wait()
        if not self._buffers.buffers:  # the commit of what it receives keeps this layout's order (receive)
            self._buffers.buffers = [faulted_in(shape, dtype) for _, _, shape, dtype in layout]
            made.extend(self._buffers.buffers)
        return sum(t.numel() * t.element_size() for t in made)

    def restore(self) -> None:
        params = self._params()
        state = self.optimizer.state
        if not (self._stepped and self._buffers.untouched):
            saved_params = {i for i, _ in self._layout} | {i for i, _ in self._values}
            for i, p in enumerate(params):
                if i not in saved_params:
                    state.pop(p, None)  # state created after the commit did not exist then
            live = []
            for (i, key), buf in zip(self._layout, self._buffers.buffers, strict=True):
                st = state.setdefault(params[i], {})
                current = st.get(key)
                if not (
                    isinstance(current, torch.Tensor)
                    and current.shape == buf.shape
                    and current.dtype == buf.dtype
                    and current.device == buf.device
                ):
                    current = st[key] = torch.empty_like(buf)
                live.append(current)
            self._buffers.restore(live, [self._stepped] * len(live))
            for (i, key), v in self._values.items():
                state.setdefault(params[i], {})[key] = copy.deepcopy(v)
            saved_keys = set(self._layout) | set(self._values)
            for i, p in enumerate(params):
                for key in [k for k in state.get(p, {}) if (i, k) not in saved_keys]:
                    del state[p][key]
        for group, hyper in zip(self.optimizer.param_groups, self._hyper, strict=True):
            group.update(copy.deepcopy(hyper))

    def sync(self) -> None:
        _sync_from_rank0(self)

    def describe(self) -> dict[str, Any]:
        layout, tensors, values = self._state_items()
        return {
            "tensors": [(i, key, tuple(t.shape), t.dtype) for (i, key), t in zip(layout, tensors, strict=True)],
            "values": values,
            "hyper": self._hyper_params(),
        }

    def receive(self, skeleton: dict[str, Any]) -> None:
        params = self._params()
        state = self.optimizer.state
        wanted = {(i, key) for i, key, _, _ in skeleton["tensors"]} | set(skeleton["values"])
        for i, p in enumerate(params):
            for key in [k for k in state.get(p, {}) if (i, k) not in wanted]:
                del state[p][key]
            if p in state and not state[p]:
                del state[p]
        group_of = _group_of(self.optimizer)
        where: dict[tuple[Any, ...], torch.device] = {}  # a few kinds of tensor, thousands of tensors
        for i, key, shape, dtype in skeleton["tensors"]:
            # where torch puts it (a moment on the parameter's device, AdamW's step on the host), learnt from an
            # empty tensor; the dtype stays rank 0's, whose bytes it receives
            kind = (group_of[i], key, params[i].device, params[i].dtype, dtype)
            if kind not in where:
                hyper = skeleton["hyper"][group_of[i]]
                where[kind] = placed(params[i], torch.empty(0, dtype=dtype), i, key, hyper).device
            device = where[kind]
            st = state.setdefault(params[i], {})
            current = st.get(key)
            if not (
                isinstance(current, torch.Tensor)
                and tuple(current.shape) == shape
                and current.dtype == dtype
                and current.device == device
            ):
                ready = self._prepared.pop((i, key), None)
                if (
                    ready is not None
                    and tuple(ready.shape) == shape
                    and ready.dtype == dtype
                    and ready.device == device
                ):
                    st[key] = ready  # allocated and faulted in while this newcomer waited (see prepare)
                else:
                    st[key] = torch.empty(shape, dtype=dtype, device=device)
        for (i, key), v in skeleton["values"].items():
            state.setdefault(params[i], {})[key] = v
        for group, hyper in zip(self.optimizer.param_groups, skeleton["hyper"], strict=True):
            group.update(hyper)

    def after_sync(self) -> None:
        self._prepared.clear()  # what a sync did not take

    def tensors(self) -> list[torch.Tensor]:
        # by key: the same order on every rank, whatever order each rank's optimizer created its state in
        return self._state_items(ordered=True)[1]

    def snapshot(self) -> dict[str, Any]:
        # save() replaces layout, values and hyper-parameters; only the tensor buffers are reused
        return {"layout": self._layout, "tensors": self._buffers.copies(), "values": self._values, "hyper": self._hyper}

    def load_snapshot(self, snapshot: dict[str, Any]) -> None:
        if len(snapshot["hyper"]) != len(self.optimizer.param_groups):
            raise ValueError(
                f"the checkpoint's optimizer has {len(snapshot['hyper'])} param groups, "
                f"this one has {len(self.optimizer.param_groups)}"
            )
        params = self._params()
        if any(i >= len(params) for i, _ in list(snapshot["layout"]) + list(snapshot["values"])):
            raise ValueError(
                f"the checkpoint's optimizer state covers more than this optimizer's {len(params)} parameters"
            )
        group_of = _group_of(self.optimizer)
        self._buffers.wait()
        self._layout = list(snapshot["layout"])
        # read onto the host: placed as torch's load_state_dict places them (moments beside their parameters)
        self._buffers.buffers = [
            placed(params[i], t, i, key, snapshot["hyper"][group_of[i]])
            for (i, key), t in zip(self._layout, snapshot["tensors"], strict=True)
        ]
        self._buffers.untouched = False
        self._values = snapshot["values"]
        self._hyper = snapshot["hyper"]
        self.restore()


def broadcast_optimizer_state(optimizer: Any, root_rank: int = 0) -> None:
    """Copy `root_rank`'s optimizer state and hyper-parameters to every rank, as Horovod's helper does."""
    if root_rank != 0:
        raise ValueError("broadcast_optimizer_state broadcasts from rank 0, the oldest survivor")
    OptimizerHandler(optimizer).sync()
