"""PyTorch support: `TorchState`, `ElasticSampler`, `DistributedOptimizer`, `prepare_model` (DDP), `get_device`.

import ray_elastic as elastic
opt = elastic.torch.DistributedOptimizer(opt, named_parameters=model.named_parameters())
sampler = elastic.torch.ElasticSampler(dataset, shuffle=True, seed=0)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)   # opt is a torch.optim.Optimizer
state = elastic.torch.TorchState(model=model, optimizer=opt, sampler=sampler, scheduler=sched, epoch=0)

or, with torch's DistributedDataParallel, a plain optimizer and a plain DataLoader (Ray Train's names):

device = elastic.torch.get_device()        # the worker's GPU when Ray gave it one, else the CPU
model = elastic.torch.prepare_model(model)  # moved to get_device(), then wrapped
loader = elastic.torch.prepare_data_loader(DataLoader(dataset, batch_size=64, shuffle=True))
state = elastic.torch.TorchState(model=model, optimizer=opt, loader=loader, epoch=0)
"""

# TorchState's checkpoint form (state dicts users open with torch.load), registered with the checkpoints
from ray_elastic.torch import checkpoint_form as _checkpoint_form  # noqa: F401  (registers the form)
from ray_elastic.torch.broadcast import broadcast_parameters
from ray_elastic.torch.data_loader import ElasticDataLoader, prepare_data_loader
from ray_elastic.torch.ddp import ElasticDDP, prepare_model
from ray_elastic.torch.device import get_device
from ray_elastic.torch.handler import StateHandler
from ray_elastic.torch.optimizer import DistributedOptimizer
from ray_elastic.torch.optimizer_handler import broadcast_optimizer_state
from ray_elastic.torch.rng import RngState
from ray_elastic.torch.sampler import ElasticSampler
from ray_elastic.torch.state import TorchState, register_handler

__all__ = [
    "DistributedOptimizer",
    "ElasticDataLoader",
    "ElasticDDP",
    "ElasticSampler",
    "RngState",
    "StateHandler",
    "TorchState",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "get_device",
    "prepare_data_loader",
    "prepare_model",
    "register_handler",
]
