"""Horovod's examples/ray elastic scripts, written again with two import lines changed and MNIST made synthetic.

    RAY_ADDRESS=... python tests/support/horovod_scripts/ray_elastic_train.py --executor elastic-ray \\
        --log LOG --kill-at 0,6 --change-frequency-s 8

The shape of examples/ray/pytorch_ray_elastic.py (basic_ray_elastic.py has
its own script beside this one, basic_ray_elastic.py):
`hvd.init()` inside the training function, an `ElasticSampler` over a
dataset of MNIST's shape (1x28x28 images, 10 classes; random, so nothing is
downloaded), the small convolutional net, SGD wrapped in
`hvd.DistributedOptimizer` with the learning rate scaled by `hvd.size()`, a
reset callback rescaling it, `hvd.elastic.TorchState`, `state.commit()`
every few batches and `check_host_updates()` between, one
`@hvd.elastic.run` function, rank 0 logging through `ray_logger.log` to a
progress callback, and `TestDiscovery` withdrawing and giving back hosts on
a schedule. `--executor elastic-ray` runs it with `ElasticRayExecutor`,
`--executor ray` with `RayExecutor(min_workers=..., max_workers=...)`.

For the tests: `--kill-at EPOCH,BATCH` makes rank 1 SIGKILL itself there,
or at the first batch after it that has a rank 1, once; rank 0 appends a
JSON line to LOG per epoch (world size, learning rate, samples processed)
and the script prints the executor's result.
"""

import argparse
import json
import os
import signal
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import ray_elastic.horovod.torch as hvd
from ray_elastic.horovod.ray import ray_logger
from ray_elastic.horovod.ray.elastic import TestDiscovery
from ray_elastic.horovod.torch.elastic.sampler import ElasticSampler

parser = argparse.ArgumentParser(description="PyTorch MNIST-shaped elastic example")
parser.add_argument("--executor", choices=["elastic-ray", "ray"], default="elastic-ray")
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--samples", type=int, default=512)
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--batches-per-commit", type=int, default=4)
parser.add_argument("--batches-per-host-check", type=int, default=1)
parser.add_argument("--change-frequency-s", type=float, default=8)
parser.add_argument("--min-hosts", type=int, default=1)
parser.add_argument("--max-hosts", type=int, default=2)
parser.add_argument("--batch-seconds", type=float, default=0.0, help="pace of a batch (the tests slow it down)")
parser.add_argument("--log", required=True, help="JSON lines, appended to by rank 0")
parser.add_argument("--kill-at", default=None, help="EPOCH,BATCH: rank 1 SIGKILLs itself there, once")
args = parser.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = F.relu(self.fc1(x.view(-1, 320)))
        return F.log_softmax(self.fc2(x), dim=1)


def synthetic_mnist():
    generator = torch.Generator().manual_seed(args.seed)
    images = torch.randn(args.samples, 1, 28, 28, generator=generator)
    labels = torch.randint(0, 10, (args.samples,), generator=generator)
    return torch.utils.data.TensorDataset(images, labels)


class ProgressCallback:
    """What a horovod.ray user's tqdm callback sees: one dict per step from rank 0."""

    def __init__(self):
        self.steps = 0
        self.world_sizes = set()

    def __call__(self, info):
        self.steps += 1
        self.world_sizes.add(info["world_size"])
        if info["batch"] == 0:
            print(f"[callback] epoch {info['epoch']} world size {info['world_size']} loss {info['train/loss']:.4f}")


def maybe_kill(epoch, batch):
    # at the first batch from there on where a rank 1 exists: the world may be 1 then, as discovery changes it
    if args.kill_at is None or hvd.rank() != 1 or (epoch, batch) < tuple(map(int, args.kill_at.split(","))):
        return
    try:  # once per run, whoever holds rank 1 then
        os.close(os.open(args.log + ".killed", os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return
    os.kill(os.getpid(), signal.SIGKILL)


def train_fn():
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    dataset = synthetic_mnist()
    train_sampler = ElasticSampler(dataset, shuffle=True, seed=args.seed)
    train_loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=train_sampler)

    model = Net()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    def on_state_reset():
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()

    state = hvd.elastic.TorchState(model, optimizer, train_sampler=train_sampler, epoch=0, batch=0)
    state.register_reset_callbacks([on_state_reset])

    @hvd.elastic.run
    def full_train(state):
        while state.epoch < args.epochs:
            state.model.train()
            for batch_idx, (data, target) in enumerate(train_loader):
                maybe_kill(state.epoch, state.batch)
                state.optimizer.zero_grad()
                loss = F.nll_loss(state.model(data), target)
                loss.backward()
                state.optimizer.step()
                state.train_sampler.record_batch(batch_idx, args.batch_size)
                if hvd.rank() == 0:
                    ray_logger.log(
                        {
                            "train/loss": loss.item(),
                            "epoch": state.epoch,
                            "batch": state.batch,
                            "world_size": hvd.size(),
                        }
                    )
                time.sleep(args.batch_seconds)
                state.batch += 1
                if state.batch % args.batches_per_commit == 0:
                    state.commit()
                elif state.batch % args.batches_per_host_check == 0:
                    state.check_host_updates()
            if hvd.rank() == 0:
                with open(args.log, "a") as f:
                    record = {
                        "epoch": state.epoch,
                        "size": hvd.size(),
                        "lr": optimizer.param_groups[0]["lr"],
                        "processed": state.train_sampler.num_processed,
                    }
                    f.write(json.dumps(record) + "\n")
            state.epoch += 1
            state.batch = 0
            state.train_sampler.set_epoch(state.epoch)
            state.commit()

    full_train(state)
    checksum = float(np.sum([p.detach().double().sum().item() for p in model.parameters()]))
    return {"rank": hvd.rank(), "size": hvd.size(), "checksum": checksum}


if __name__ == "__main__":
    import ray

    ray.init(address="auto")
    discovery = TestDiscovery(
        min_hosts=args.min_hosts,
        max_hosts=args.max_hosts,
        change_frequency_s=args.change_frequency_s,
        use_gpu=False,
        cpus_per_slot=1,
        verbose=False,
    )
    callback = ProgressCallback()
    if args.executor == "elastic-ray":
        from ray_elastic.horovod.ray import ElasticRayExecutor

        settings = ElasticRayExecutor.create_settings(min_num_proc=1, max_num_proc=4, verbose=1)
        settings.discovery = discovery
        executor = ElasticRayExecutor(settings, use_gpu=False, cpus_per_slot=1, override_discovery=False)
        executor.start()
        results = executor.run(lambda: train_fn(), callbacks=[callback])
    else:
        from ray_elastic.horovod.ray import RayExecutor

        settings = RayExecutor.create_settings(timeout_s=30)
        settings.discovery = discovery
        executor = RayExecutor(settings, min_workers=1, max_workers=4, cpus_per_worker=1, override_discovery=False)
        executor.start()
        results = executor.run(train_fn, callbacks=[callback])
        executor.shutdown()
    print(f"[callback] {callback.steps} steps at world sizes {sorted(callback.world_sizes)}")
    print("RESULTS " + json.dumps(results))
