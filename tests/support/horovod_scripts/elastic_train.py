"""Elastic training written as a Horovod Elastic script: only the import line names ray_elastic.

    ray-elastic run tests/support/horovod_scripts/elastic_train.py -np 2 --min-np 1 --max-np 4 \\
        --host-discovery-script ./discover.sh -- --log LOG --stop-file STOP

hvd.init() at the top level, a model and an SGD optimizer wrapped in
hvd.DistributedOptimizer, an ElasticSampler held by the TorchState,
state.commit() every few batches and check_host_updates() between, a reset
callback that rescales the learning rate with hvd.size(), and one
@hvd.elastic.run function. For the tests, it trains epoch after epoch until
STOP exists (rank 0 decides for all), appending JSON lines to LOG: one per
reset and one per epoch end, with the world size, the learning rate, how many
samples of the epoch the sampler counts as processed, how many times each
sample was trained (a count the state holds, so a rollback rolls it back too)
and a checksum of the model. With --kill-at EPOCH,BATCH the rank --kill-rank SIGKILLs itself there,
once per run.
"""

import argparse
import json
import os
import signal
import time

import torch
import torch.nn.functional as F

import ray_elastic.horovod.torch as hvd

parser = argparse.ArgumentParser(description="Horovod-style elastic training")
parser.add_argument("--log", required=True, help="JSON lines file, appended to")
parser.add_argument("--stop-file", required=True, help="training ends at the first epoch end after it exists")
parser.add_argument("--max-epochs", type=int, default=200)
parser.add_argument("--samples", type=int, default=256)
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--batches-per-commit", type=int, default=2)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--batch-seconds", type=float, default=0.02, help="pace of a batch")
parser.add_argument("--kill-at", default=None, help="EPOCH,BATCH")
parser.add_argument("--kill-rank", type=int, default=1)
args = parser.parse_args()

hvd.init()
torch.manual_seed(0)

# each sample carries its index, so the script can count what it trained
dataset = torch.utils.data.TensorDataset(
    torch.randn(args.samples, 8), torch.randint(0, 2, (args.samples,)), torch.arange(args.samples)
)
sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=1)
loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
kill_at = tuple(int(v) for v in args.kill_at.split(",")) if args.kill_at else None


def log(**record):
    with open(args.log, "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "rank": hvd.rank(), "size": hvd.size(), **record}) + "\n")


def checksum():
    return sum(float(p.detach().double().sum()) for p in model.parameters())


def maybe_kill(epoch, batch):
    if kill_at != (epoch, batch) or hvd.rank() != args.kill_rank:
        return
    try:  # once per run, whoever holds the rank then
        os.close(os.open(args.log + ".killed", os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return
    log(event="kill", epoch=epoch, batch=batch)
    os.kill(os.getpid(), signal.SIGKILL)


@hvd.elastic.run
def train(state):
    while state.epoch < args.max_epochs:
        for i, (data, target, index) in enumerate(loader):
            maybe_kill(state.epoch, state.batch)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
            trained = torch.zeros(args.samples, dtype=torch.int64).index_add_(0, index, torch.ones_like(index))
            state.trained = state.trained + hvd.allreduce(trained, op=hvd.Sum, name="trained")
            time.sleep(args.batch_seconds)
            state.sampler.record_batch(i, args.batch_size)
            state.batch += 1
            if state.batch % args.batches_per_commit == 0:
                state.commit()
            else:
                state.check_host_updates()
        if hvd.rank() == 0:
            log(
                event="epoch_end",
                epoch=state.epoch,
                processed=state.sampler.num_processed,
                padding=state.sampler.padding_trained,
                trained_min=int(state.trained.min()),
                trained_total=int(state.trained.sum()),
                lr=optimizer.param_groups[0]["lr"],
                checksum=checksum(),
            )
        stop = hvd.broadcast_object(os.path.exists(args.stop_file), root_rank=0)
        state.epoch += 1
        state.batch = 0
        state.sampler.set_epoch(state.epoch)
        state.trained = torch.zeros(args.samples, dtype=torch.int64)
        state.commit()
        if stop:
            break


def on_state_reset():
    for group in optimizer.param_groups:
        group["lr"] = args.lr * hvd.size()
    log(event="reset", lr=optimizer.param_groups[0]["lr"])


trained = torch.zeros(args.samples, dtype=torch.int64)
state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0, trained=trained)
state.register_reset_callbacks([on_state_reset])
train(state)
print(f"finished epoch {state.epoch} size {hvd.size()} checksum {checksum():.17g}")
