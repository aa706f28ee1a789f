"""Horovod's PyTorch API as a Horovod script calls it, each result checked; prints `api ok` per rank.

    ray-elastic run tests/support/horovod_scripts/api_check.py -np 2

Written like a Horovod script (hvd.init() at the top level, Horovod's
signatures and names); only the import line names ray_elastic. Any wrong
result raises, which fails the run with this rank's traceback.
"""

import os

import torch

import ray_elastic.horovod.torch as hvd
from ray_elastic.horovod.common.exceptions import HorovodInternalError

hvd.init()
r, n = hvd.rank(), hvd.size()
total = n * (n + 1) / 2  # sum of (rank + 1) over ranks


def check(what, got, want):
    want = torch.as_tensor(want, dtype=got.dtype).expand_as(got) if torch.is_tensor(got) else want
    same = torch.allclose(got, want, rtol=1e-3) if torch.is_tensor(got) else got == want
    if not same:
        raise AssertionError(f"rank {r}: {what}: got {got}, want {want}")


check("HOROVOD_RANK", os.environ["HOROVOD_RANK"], str(r))
check("HOROVOD_SIZE", os.environ["HOROVOD_SIZE"], str(n))
check("is_initialized", hvd.is_initialized(), True)
check("local_size", hvd.local_size() >= 1 and hvd.cross_size() >= 1, True)

x = torch.full((3,), float(r + 1))
check("allreduce average", hvd.allreduce(x, name="avg"), total / n)
check("allreduce Sum", hvd.allreduce(x, op=hvd.Sum), total)
check("allreduce average=False", hvd.allreduce(x, average=False), total)
check("allreduce Min", hvd.allreduce(x, op=hvd.Min), 1.0)
check("allreduce Max", hvd.allreduce(x, op=hvd.Max), float(n))
check("pre/postscale", hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=3.0), 6 * total)
fp16 = hvd.allreduce(x, compression=hvd.Compression.fp16)
check("fp16 dtype back", fp16.dtype, torch.float32)
check("fp16 value", fp16, total / n)
check("input untouched", x, float(r + 1))
y = x.clone()
check("allreduce_ returns it", hvd.allreduce_(y, op=hvd.Sum) is y, True)
check("allreduce_ in place", y, total)
a, b = hvd.grouped_allreduce([x, 2 * x], op=hvd.Sum)
check("grouped_allreduce", torch.cat([a, b]), torch.tensor([total] * 3 + [2 * total] * 3))
handle = hvd.allreduce_async(x, op=hvd.Sum)
check("poll", hvd.poll(handle), True)
check("synchronize", hvd.synchronize(handle), total)
check("allreduce of a scalar tensor", hvd.allreduce(torch.tensor(float(r)), name="metric"), (n - 1) / 2)

gathered = hvd.allgather(torch.full((r + 1, 2), float(r)))
check("allgather rows", gathered.shape[0], n * (n + 1) // 2)
check("allgather order", gathered[:, 0], torch.tensor([float(k) for k in range(n) for _ in range(k + 1)]))
check("broadcast", hvd.broadcast(torch.tensor([float(r)]), root_rank=n - 1), float(n - 1))
z = torch.tensor([float(r)])
hvd.broadcast_(z, 0)
check("broadcast_", z, 0.0)
check("broadcast_object", hvd.broadcast_object({"from": r}, root_rank=0), {"from": 0})
check("allgather_object", hvd.allgather_object(r), list(range(n)))
hvd.barrier()

# gradients flow through allreduce as in Horovod: d/dw of sum_k allreduce_sum((k+1) w) on this rank = (r+1) n
w = torch.ones(2, requires_grad=True)
hvd.allreduce(w * (r + 1), op=hvd.Sum).sum().backward()
check("allreduce backward", w.grad, float((r + 1) * n))

for call, name in ((lambda: hvd.allreduce(x, op=hvd.Adasum), "Adasum"), (lambda: hvd.join(), "join")):
    try:
        call()
    except NotImplementedError as e:
        check(f"{name} error names it", name in str(e), True)
    else:
        raise AssertionError(f"{name} did not raise")
check("alltoall is absent", hasattr(hvd, "alltoall"), False)

# DistributedOptimizer: two accumulated backward passes per step, the sum averaged over ranks
torch.manual_seed(r)  # different weights per rank, until broadcast_parameters
model = torch.nn.Linear(4, 1, bias=False)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
start = model.weight.detach().clone()
optimizer = hvd.DistributedOptimizer(
    optimizer,
    named_parameters=model.named_parameters(),
    backward_passes_per_step=2,
    op=hvd.Average,
    gradient_predivide_factor=1.0,
)


def inputs(rank, step):
    return torch.arange(4, dtype=torch.float32) + rank + step


for step in range(2):
    model(inputs(r, step)).sum().backward()
optimizer.step()
# d/dw sum(w . v) = v: each rank's accumulated grad is inputs(rank, 0) + inputs(rank, 1)
want = start - 0.1 * sum(inputs(k, 0) + inputs(k, 1) for k in range(n)) / n
check("DistributedOptimizer step", model.weight.detach(), want)

optimizer.zero_grad()
for step in range(2):
    model(inputs(r, step)).sum().backward()
optimizer.synchronize()
torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
with optimizer.skip_synchronize():
    optimizer.step()
for _ in range(2):  # plain steps in a row, as every training loop makes them
    optimizer.zero_grad()
    for step in range(2):
        model(inputs(r, step)).sum().backward()
    optimizer.step()
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
weights = hvd.allgather(model.weight.detach())
check("ranks hold equal weights", bool((weights == weights[0]).all()), True)
check("HorovodInternalError is the library's", HorovodInternalError.__module__, "ray_elastic.exceptions")
print(f"api ok rank {r} of {n}")
