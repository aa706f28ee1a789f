"""Autoscaler requests that add up across the runs of one cluster.

Ray's `request_resources()` keeps one cluster-wide request: each call replaces
the last, so two runs calling it would overwrite each other, and a run that
dies would leave its request behind. Here each run keeps its own share in
Ray's internal KV (namespace `ray_elastic`, key `autoscale:<run_id>`, with an
expiry the live driver renews) and every change asks the autoscaler for the
sum of the live shares. A run withdraws its share when it ends, from the
driver and again from `fit()`'s clean-up (an interrupted `fit()` included); a
share whose run died without withdrawing expires after `SHARE_TTL_S`.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING

from ray.autoscaler.sdk import request_resources

from ray_elastic import ray_private

if TYPE_CHECKING:
    from collections.abc import Mapping

logger = logging.getLogger(__name__)

SHARE_TTL_S = 120.0  # a share not renewed for this long belongs to a run that died
_NAMESPACE = "ray_elastic"
_PREFIX = "autoscale:"


def set_share(run_id: str, bundle: Mapping[str, float], count: int) -> None:
    """Ask for `count` bundles for this run (0 withdraws), then request the sum of every live run's share."""
    key = f"{_PREFIX}{run_id}"
    if count > 0:
        share = {"bundle": dict(bundle), "count": count, "expires": time.time() + SHARE_TTL_S}
        ray_private.kv_put(key, json.dumps(share), overwrite=True, namespace=_NAMESPACE)
    else:
        ray_private.kv_del(key, namespace=_NAMESPACE)
    request_resources(bundles=all_bundles())


def all_bundles() -> list[dict[str, float]]:
    """Every live run's bundles; expired shares are deleted on the way."""
    bundles: list[dict[str, float]] = []
    now = time.time()
    for key in sorted(ray_private.kv_list(_PREFIX, namespace=_NAMESPACE)):
        raw = ray_private.kv_get(key, namespace=_NAMESPACE)
        if raw is None:
            continue
        share = json.loads(raw)
        if share["expires"] < now:
            logger.info("dropping the expired autoscaler share %s", key)
            ray_private.kv_del(key, namespace=_NAMESPACE)
            continue
        bundles.extend([share["bundle"]] * share["count"])
    return bundles


def withdraw(run_id: str) -> None:
    """Withdraw this run's share if it has one; never raises (a run's clean-up must go on).

    A run without a share leaves the cluster's request alone: it may be a
    request somebody made outside ray-elastic.
    """
    try:
        if ray_private.kv_exists(f"{_PREFIX}{run_id}", namespace=_NAMESPACE):
            set_share(run_id, {}, 0)
    except Exception as e:  # noqa: BLE001 - a cluster without an autoscaler, or a GCS gone
        logger.debug("could not withdraw the autoscaler share of run %s: %s", run_id, e)
