"""horovod.ray's `elastic_v2` module path: its discoveries, for `from horovod.ray.elastic_v2 import TestDiscovery`.

horovod.ray's `RayExecutor(min_workers=...)` takes its discoveries from
here, with `cpus_per_worker`/`gpus_per_worker` where the older module says
`cpus_per_slot`/`gpus_per_slot`; ray-elastic's `RayHostDiscovery` and
`TestDiscovery` take both spellings (the positions are the same), so this
module names the same classes. Its `ElasticParams` and `ElasticAdapter` are
horovod.ray's internals, replaced by ray-elastic's driver: not provided.
"""

from ray_elastic.horovod.ray.elastic import HostDiscovery, RayHostDiscovery, TestDiscovery

__all__ = ["HostDiscovery", "RayHostDiscovery", "TestDiscovery"]
