"""Horovod's import path for the sampler: `from ray_elastic.horovod.torch.elastic.sampler import ElasticSampler`.

Horovod's examples (examples/ray/basic_ray_elastic.py) import the sampler
from this module rather than from `hvd.elastic`; it is the same class.
"""

from ray_elastic.torch import ElasticSampler

__all__ = ["ElasticSampler"]
