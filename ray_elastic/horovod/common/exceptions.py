"""Horovod's exceptions under the module path Horovod scripts import them from.

    from ray_elastic.horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

They are ray-elastic's own classes (not copies), so `except` clauses in a
script catch what the library raises.
"""

from ray_elastic import HorovodInternalError, HostsUpdatedInterrupt

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt"]
