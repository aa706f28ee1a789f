"""`examples/digits.py` written as PyTorch users write it: DistributedDataParallel.

The same model, data and elastic loop as `digits.py`, with two lines
changed: the model is wrapped by `elastic.torch.prepare_model` (torch's
DistributedDataParallel over the elastic ring, rebuilt after every reset)
and the optimizer is a plain `torch.optim.SGD` (DDP already averages the
gradients). `TorchState` holds the prepared model; its state is the plain
module's. A Ray Train script moves over by swapping
`ray.train.torch.prepare_model` for this one (see
docs/migrating-from-ray-train.md).

After every sync the ranks compare digests of their parameters and
optimizer state, as `digits.py` does.

    python examples/digits_ddp.py        # on a local Ray it starts
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from digits import DEFAULTS, accuracy, load_data, make_model, state_digest
from torch.utils.data import DataLoader, TensorDataset

import ray_elastic as elastic


def train_fn(config: dict) -> dict:
    cfg = {**DEFAULTS, **config}
    step_hook: Callable[[int], None] | None = cfg.get("step_hook")
    torch.manual_seed(cfg["seed"])
    x_train, y_train, x_test, y_test = load_data(cfg["seed"])
    dataset = TensorDataset(x_train, y_train)
    model = elastic.torch.prepare_model(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    sampler = elastic.torch.ElasticSampler(dataset, shuffle=True, seed=cfg["seed"])
    loader = DataLoader(dataset, batch_size=cfg["batch_size"], sampler=sampler)
    state = elastic.torch.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0)

    def scale_lr() -> None:
        for group in optimizer.param_groups:
            group["lr"] = cfg["lr"] * elastic.size()

    state.register_reset_callbacks([scale_lr])
    sync_checks: list[dict] = []

    @elastic.run
    def train(state: elastic.torch.TorchState) -> dict:
        scale_lr()
        digests = elastic.allgather_object(state_digest(model.module, optimizer))
        sync_checks.append({"step": state.step, "world_size": elastic.size(), "equal": len(set(digests)) == 1})
        while state.epoch < cfg["epochs"]:
            for i, (x, y) in enumerate(loader):
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()  # DDP averages the gradients while backward runs
                optimizer.step()
                sampler.record_batch(i, cfg["batch_size"])
                state.step += 1
                elastic.report(
                    {"epoch": state.epoch, "step": state.step, "loss": loss.item(), "world_size": elastic.size()}
                )
                if step_hook is not None:
                    step_hook(state.step)
                if state.step % cfg["commit_every"] == 0:
                    state.commit()
                else:
                    state.check_host_updates()  # the ranks agreed inside DDP's gradient allreduce: no extra call
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            state.commit()
        final = elastic.allgather_object(state_digest(model.module, optimizer))
        return {
            "accuracy": accuracy(model.module, x_test, y_test),
            "steps": state.step,
            "world_size": elastic.size(),
            "final_digests": final,
            "sync_checks": sync_checks,
            "padding_trained": sampler.padding_trained,
        }

    return train(state)


def main() -> None:
    result = elastic.ElasticTrainer(train_fn, min_workers=2, max_workers=4, config={"epochs": 15}).fit()
    print(f"test accuracy: {result.return_value['accuracy']:.3f} after {result.return_value['steps']} steps")


if __name__ == "__main__":
    main()
