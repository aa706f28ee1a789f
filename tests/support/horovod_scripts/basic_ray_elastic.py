"""horovod's examples/ray/basic_ray_elastic.py, written again: two imports changed, MNIST made synthetic.

    RAY_ADDRESS=... python tests/support/horovod_scripts/basic_ray_elastic.py --no-cuda --epochs 3 \\
        --samples 512 --checkpoint-format /tmp/ckpt-{epoch}.pth.tar --log-dir /tmp/logs

The shape of horovod's script, part for part: `run(large=True)` in every
worker (`hvd.init()`, the learning rate scaled by the world size,
`hvd.DistributedOptimizer`, a `CosineAnnealingLR` whose `base_lrs` a reset
callback rescales, `hvd.elastic.TorchState` holding model, optimizer,
scheduler and sampler, `@hvd.elastic.run` over epochs, a checkpoint per
epoch from rank 0, metrics averaged with `hvd.allreduce(name=...)`, rank 0
logging each step through `ray_logger.log`); on the driver,
`ElasticRayExecutor.create_settings(verbose=2)`, a `TestDiscovery` as
`settings.discovery`, `override_discovery=False` and
`executor.run(lambda: run(large=True), callbacks=[...])`.

Where it differs, and why:
- the imports: `ray_elastic.horovod.torch` and `ray_elastic.horovod.ray`;
- data: random tensors of MNIST's shape (1x28x28, 10 classes; `--samples`
  of them), so nothing is downloaded and no torchvision is needed;
- `use_gpu=False` (the test cluster has no GPU);
- horovod's parser declares `--data-dir` twice, which argparse refuses:
  declared once here;
- the second callback writes each logged dict as a JSON line in
  `--log-dir/scalars.jsonl` where horovod's writes TensorBoard scalars
  (tensorboard is not a dependency of this project);
- for the tests only: `--samples`, `--min-hosts`/`--max-hosts` (horovod:
  2 and 5), `--kill-at EPOCH,BATCH` (rank 1 SIGKILLs itself there or at the first batch after it where there is a
  rank 1, once)
  and a `RESULTS` line with `executor.run()`'s value.

As in horovod's script, batches are not recorded in the sampler and each
`train()` call starts its epoch over (`set_epoch`): an epoch cut by a reset
is trained again from its start, which the test accounts for.
"""

import argparse
import json
import os
import signal

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from tqdm import tqdm

import ray_elastic.horovod.torch as hvd
from ray_elastic.horovod.ray import ray_logger
from ray_elastic.horovod.ray.elastic import TestDiscovery
from ray_elastic.horovod.torch.elastic.sampler import ElasticSampler

# Training settings
parser = argparse.ArgumentParser(
    description="PyTorch MNIST Example", formatter_class=argparse.ArgumentDefaultsHelpFormatter
)
parser.add_argument("--log-dir", default="./logs", help="scalars log directory")
parser.add_argument("--checkpoint-format", default="./checkpoint-{epoch}.pth.tar", help="checkpoint file format")
parser.add_argument("--data-dir", default="./new_data", help="unused: the data is synthetic")
parser.add_argument("--epochs", type=int, default=90, help="number of epochs to train")
parser.add_argument("--lr", type=float, default=0.01, help="learning rate for a single GPU")
parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
parser.add_argument("--seed", type=int, default=42, help="random seed")
parser.add_argument("--forceful", action="store_true", help="Removes the node upon deallocation (non-gracefully).")
parser.add_argument("--change-frequency-s", type=int, default=20, help="seconds between TestDiscovery's changes")
parser.add_argument(
    "--batches-per-commit",
    type=int,
    default=50,
    help="number of batches processed before calling `state.commit()`",
)
parser.add_argument(
    "--batches-per-host-check",
    type=int,
    default=10,
    help="number of batches processed before calling `state.check_host_updates()`",
)
# for the tests
parser.add_argument("--samples", type=int, default=60000, help="synthetic samples (MNIST's training set: 60000)")
parser.add_argument("--min-hosts", type=int, default=2)
parser.add_argument("--max-hosts", type=int, default=5)
parser.add_argument("--kill-at", default=None, help="EPOCH,BATCH: rank 1 SIGKILLs itself there, once")

args = parser.parse_args()


def load_data_mnist():
    # Horovod: limit # of CPU threads to be used per worker (one: the test nodes have 2 CPUs).
    torch.set_num_threads(1)

    generator = torch.Generator().manual_seed(args.seed)
    images = torch.randn(args.samples, 1, 28, 28, generator=generator)
    labels = torch.randint(0, 10, (args.samples,), generator=generator)
    train_dataset = torch.utils.data.TensorDataset(images, labels)
    train_sampler = ElasticSampler(train_dataset)
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=8, sampler=train_sampler)

    return train_loader, train_sampler


class tqdm_callback:
    def __init__(self):
        self._progress_bar = None
        self._current_epoch = None
        self._world_size = None
        self._mode = None

    def __call__(self, info):
        tqdm_mode = info["tqdm_mode"]
        assert tqdm_mode in {"val", "train"}
        reset = False
        if self._mode != tqdm_mode or self._current_epoch != info["epoch"] or self._world_size != info["world_size"]:
            reset = True
            self._mode = tqdm_mode
            self._current_epoch = info["epoch"]
            self._world_size = info["world_size"]

        if reset:
            if self._progress_bar is not None:
                self._progress_bar.close()
            epoch = self._current_epoch + 1
            self._progress_bar = tqdm(total=info["total"], desc=f"[mode={tqdm_mode}] Epoch     #{epoch}")

        scoped = {k: v for k, v in info.items() if k.startswith(tqdm_mode)}
        self._progress_bar.set_postfix(scoped)
        self._progress_bar.update(1)


class ScalarsCallback:
    """Where horovod's TensorboardCallback writes scalars: every logged dict, one JSON line."""

    def __init__(self, logdir):
        os.makedirs(logdir, exist_ok=True)
        self.path = os.path.join(logdir, "scalars.jsonl")

    def __call__(self, info):
        with open(self.path, "a") as f:
            f.write(json.dumps(info) + "\n")


def maybe_kill(epoch, batch):
    # at the first batch from there on where a rank 1 exists: the world may be 1 then, as discovery changes it
    if args.kill_at is None or hvd.rank() != 1 or (epoch, batch) < tuple(map(int, args.kill_at.split(","))):
        return
    marker = args.checkpoint_format.format(epoch="killed")
    try:  # once per run, whoever holds rank 1 then
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return
    os.kill(os.getpid(), signal.SIGKILL)


def train(state, train_loader):
    epoch = state.epoch
    batch_offset = state.batch

    state.model.train()
    state.train_sampler.set_epoch(epoch)
    train_loss = Metric("train_loss")
    train_accuracy = Metric("train_accuracy")

    for batch_idx, (data, target) in enumerate(train_loader):
        # Elastic Horovod: update the current batch index this epoch
        # and commit / check for host updates. Do not check hosts when
        # we commit as it would be redundant.
        state.batch = batch_offset + batch_idx
        if args.batches_per_commit > 0 and state.batch % args.batches_per_commit == 0:
            state.commit()
        elif args.batches_per_host_check > 0 and state.batch % args.batches_per_host_check == 0:
            state.check_host_updates()
        maybe_kill(epoch, state.batch)

        if args.cuda:
            data, target = data.cuda(), target.cuda()
        state.optimizer.zero_grad()

        output = state.model(data)
        train_accuracy.update(accuracy(output, target))

        loss = F.cross_entropy(output, target)
        train_loss.update(loss)
        loss.backward()
        state.optimizer.step()
        # Only log from the 0th rank worker.
        if hvd.rank() == 0:
            ray_logger.log(
                {
                    "tqdm_mode": "train",
                    "train/loss": train_loss.avg.item(),
                    "train/accuracy": 100.0 * train_accuracy.avg.item(),
                    "total": len(train_loader),
                    "epoch": epoch,
                    "world_size": hvd.size(),
                }
            )


def accuracy(output, target):
    # get the index of the max log-probability
    pred = output.max(1, keepdim=True)[1]
    return pred.eq(target.view_as(pred)).cpu().float().mean()


def save_checkpoint(state):
    if hvd.rank() == 0:
        filepath = args.checkpoint_format.format(epoch=state.epoch + 1)
        state = {
            "model": state.model.state_dict(),
            "optimizer": state.optimizer.state_dict(),
            "scheduler": state.scheduler.state_dict(),
        }
        torch.save(state, filepath)


def end_epoch(state):
    state.epoch += 1
    state.batch = 0
    state.train_sampler.set_epoch(state.epoch)
    state.commit()


# Horovod: average metrics from distributed training.
class Metric:
    def __init__(self, name):
        self.name = name
        self.sum = torch.tensor(0.0)
        self.n = torch.tensor(0.0)

    def update(self, val):
        self.sum += hvd.allreduce(val.detach().cpu(), name=self.name)
        self.n += 1

    @property
    def avg(self):
        return self.sum / self.n


class Net(nn.Module):
    def __init__(self, large=False):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 300)
        self.hiddens = []
        if large:
            self.hiddens = nn.ModuleList([nn.Linear(300, 300) for i in range(30)])
        self.fc2 = nn.Linear(300, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        if self.hiddens:
            for layer in self.hiddens:
                x = F.relu(layer(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def run(large=False):
    hvd.init()

    torch.manual_seed(args.seed)
    args.cuda = not args.no_cuda and torch.cuda.is_available()

    if args.cuda:
        # Horovod: pin GPU to local rank.
        torch.cuda.set_device(hvd.local_rank())
        torch.cuda.manual_seed(args.seed)

    # If set > 0, will resume training from a given checkpoint.
    resume_from_epoch = 0
    for try_epoch in range(args.epochs, 0, -1):
        if os.path.exists(args.checkpoint_format.format(epoch=try_epoch)):
            resume_from_epoch = try_epoch
            break

    # Load the (synthetic) MNIST-shaped dataset
    train_loader, train_sampler = load_data_mnist()

    model = Net(large=large)
    if args.cuda:
        model.cuda()

    # Horovod: scale learning rate by the number of GPUs.
    optimizer = optim.SGD(model.parameters(), lr=args.lr * np.sqrt(hvd.size()), momentum=0.9, weight_decay=5e-4)

    # Horovod: wrap optimizer with DistributedOptimizer.
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=200)

    # Restore from a previous checkpoint, if initial_epoch is specified.
    # Horovod: restore on the first worker which will broadcast
    # weights to other workers.
    if resume_from_epoch > 0 and hvd.rank() == 0:
        filepath = args.checkpoint_format.format(epoch=resume_from_epoch)
        checkpoint = torch.load(filepath)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])

    def on_state_reset():
        # Horovod: scale the learning rate as controlled by the LR schedule
        scheduler.base_lrs = [args.lr * hvd.size() for _ in scheduler.base_lrs]

    state = hvd.elastic.TorchState(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        train_sampler=train_sampler,
        epoch=resume_from_epoch,
        batch=0,
    )
    state.register_reset_callbacks([on_state_reset])

    @hvd.elastic.run
    def full_train(state, train_loader):
        while state.epoch < args.epochs:
            train(state, train_loader)
            state.scheduler.step()
            save_checkpoint(state)
            end_epoch(state)

    full_train(state, train_loader)


if __name__ == "__main__":
    import ray

    from ray_elastic.horovod.ray import ElasticRayExecutor

    ray.init(address="auto")
    settings = ElasticRayExecutor.create_settings(verbose=2)
    settings.discovery = TestDiscovery(
        min_hosts=args.min_hosts,
        max_hosts=args.max_hosts,
        change_frequency_s=args.change_frequency_s,
        use_gpu=False,
        cpus_per_slot=1,
        _graceful=not args.forceful,
        verbose=False,
    )
    executor = ElasticRayExecutor(settings, use_gpu=False, cpus_per_slot=1, override_discovery=False)
    executor.start()
    results = executor.run(lambda: run(large=True), callbacks=[tqdm_callback(), ScalarsCallback(args.log_dir)])
    print("RESULTS " + json.dumps(results))
