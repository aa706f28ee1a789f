"""What a run leaves in Ray, and how it goes away.

A run's actors live in the namespace `run_namespace(run_id)`; its placement
groups are named after it. The workers and their placement groups are
detached (they outlive a driver actor that Ray restarts), so they are
removed by name: by `fit()`'s clean-up, and by the workers themselves when
they find the run's driver dead for good (`fit()`'s caller died with it).
The driver's snapshot (`driver/shell/snapshot.py`) goes the same way.
"""

from __future__ import annotations

import logging

import ray

logger = logging.getLogger(__name__)


CONTROL_ACTORS = frozenset({"driver", "kv", "feed"})  # the run's own named actors besides its workers


def run_namespace(run_id: str) -> str:
    return f"ray_elastic_{run_id}"


def remove_run_actors(namespace: str, keep: frozenset[str] = frozenset()) -> None:
    """Kill every named actor of the run still alive (detached workers included), but those named in `keep`."""
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry.get("namespace") == namespace and entry["name"] not in keep:
            try:
                ray.kill(ray.get_actor(entry["name"], namespace=namespace), no_restart=True)
            except ValueError:  # gone in between
                pass


def remove_run_placement_groups(namespace: str, keep: frozenset[str] = frozenset()) -> None:
    """Remove the run's placement groups (named `{namespace}-{worker_id}`), but those of the workers in `keep`."""
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    for pg_id, info in placement_group_table().items():
        name = info.get("name", "")
        if name.startswith(f"{namespace}-") and info.get("state") != "REMOVED":
            if name[len(namespace) + 1 :] in keep:
                continue
            try:
                remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
            except Exception:  # noqa: BLE001 - removed concurrently
                pass


def run_placement_groups(namespace: str) -> dict[str, object]:
    """The run's placement groups not removed, by worker id."""
    from ray.util.placement_group import PlacementGroup, placement_group_table

    found = {}
    for pg_id, info in placement_group_table().items():
        name = info.get("name", "")
        if name.startswith(f"{namespace}-") and info.get("state") != "REMOVED":
            found[name[len(namespace) + 1 :]] = PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id)))
    return found
