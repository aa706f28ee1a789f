"""Where a Tune trial's workers may run: its reservation, plus what it grows into beside the others.

A trial asks Tune for `min_workers` bundles of `resources_per_worker`
(`trial_resources`): Tune starts it only once they are placed, and no other
trial can take them. The run's own workers then ask Ray for a token amount
(`NOMINAL`, one byte of memory, which takes nothing from the CPUs the
bundles count), so they run on the reservation instead of asking twice.

Growing toward `max_workers`, and room for the run's hot spares
(`spares=`, which never take a member's place in the reservation), needs
room beyond every trial's reservation:
`TrialSlots`, the run's discovery callable (it runs in the driver actor,
once per `discovery_interval`), reserves one more worker's resources at a
time in a placement group of its own, pinned to a node that shows them
free, and offers a slot there only once the group is placed. Ray ties a
placement group to its job, not to the actor that made it, so the groups
are named in the run's namespace: whatever removes the run's own groups
removes them too (`fit()`'s clean-up, or the workers when the trial's
process was killed), and the trial removes any left when its run ends
(`remove_growth`). A trial keeps what it grew into until it ends.
"""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING, Any

from ray_elastic import ray_private

if TYPE_CHECKING:
    from collections.abc import Mapping

logger = logging.getLogger(__name__)

NOMINAL = {"memory": 1.0}  # what each worker asks of Ray itself (one byte): the bundles hold the real amount
_PLACE_S = 2.0  # how long one growth group may take to be placed before it is given back


def trial_resources(min_workers: int, per_worker: Mapping[str, float]) -> list[dict[str, float]]:
    """Tune's bundles for a trial: an empty head (the trainable itself needs nothing) and one per minimum worker."""
    return [{}] + [dict(per_worker) for _ in range(min_workers)]


def fits(free: Mapping[str, float], per_worker: Mapping[str, float]) -> bool:
    return all(free.get(name, 0.0) >= amount for name, amount in per_worker.items() if amount > 0)


def node_to_grow_on(free: Mapping[str, Mapping[str, float]], per_worker: Mapping[str, float]) -> str | None:
    """The node with room for one more worker, the one with the most free CPU first (spreads the growth); or None."""
    roomy = [node for node, res in free.items() if fits(res, per_worker)]
    return max(roomy, key=lambda n: (free[n].get("CPU", 0.0), n)) if roomy else None


def growth_tag(reservation: str) -> str:
    """In the name of every growth group of the trial whose reservation (placement group) has this hex id."""
    return f"-growth-{reservation[:16]}-"


def remove_growth(reservation: str) -> None:
    """Remove the trial's growth groups (after its run's driver is gone, so no new one comes)."""
    import ray
    from ray.util.placement_group import PlacementGroup, placement_group_table

    for pg_id, info in placement_group_table().items():
        if growth_tag(reservation) in info.get("name", "") and info.get("state") != "REMOVED":
            _remove(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))


def slots(reserved: Mapping[str, int], grown: Mapping[str, int]) -> dict[str, int]:
    """`{node: slots}`: the trial's reserved bundles on each node plus the workers' room it grew into there."""
    return {node: reserved.get(node, 0) + grown.get(node, 0) for node in set(reserved) | set(grown)}


class TrialSlots:
    """The discovery callable of a trial's run: `{node_id: slots}` its workers may take.

    Args:
        reservation: the hex id of the trial's placement group (Tune's).
        per_worker: one worker's real resources (`resources_per_worker`).
        most_workers: it never reserves room for more workers than this
            (the run's `max_workers` plus its `spares`).
    """

    def __init__(self, reservation: str, per_worker: Mapping[str, float], most_workers: int) -> None:
        self.reservation = reservation
        self.per_worker = dict(per_worker)
        self.most_workers = most_workers
        self._grown: list[tuple[Any, str]] = []  # (placement group, node id) placed for growth
        self._namespace: str | None = None  # the run's, found once from inside its driver actor

    def __call__(self) -> dict[str, int]:
        import ray
        from ray.util.placement_group import placement_group_table

        table = placement_group_table()
        reserved: dict[str, int] = {}
        for node in table.get(self.reservation, {}).get("bundles_to_node_id", {}).values():
            reserved[node] = reserved.get(node, 0) + 1
        self._forget_lost(table)
        total = sum(reserved.values()) + len(self._grown)
        if reserved and total < self.most_workers and self._run_namespace(ray) is not None:
            self._grow(ray)
        grown: dict[str, int] = {}
        for _, node in self._grown:
            grown[node] = grown.get(node, 0) + 1
        return slots(reserved, grown)

    def _forget_lost(self, table: Mapping[str, Any]) -> None:
        """Drop growth groups Ray no longer holds placed (their node died, or they were removed)."""
        kept = []
        for pg, node in self._grown:
            if table.get(pg.id.hex(), {}).get("state") == "CREATED":
                kept.append((pg, node))
            else:
                _remove(pg)
        self._grown = kept

    def _run_namespace(self, ray: Any) -> str | None:
        """The namespace of the run whose driver actor calls this (the driver is named `driver` in it)."""
        if self._namespace is None:
            me = ray.get_runtime_context().get_actor_id()
            for named in ray.util.list_named_actors(all_namespaces=True):
                if named["name"] != "driver" or not named["namespace"].startswith("ray_elastic_"):
                    continue
                try:
                    if ray_private.actor_id_of(ray.get_actor("driver", namespace=named["namespace"])) == me:
                        self._namespace = named["namespace"]
                        break
                except ValueError:  # that run ended in between
                    continue
        return self._namespace

    def _grow(self, ray: Any) -> None:
        from ray.util.placement_group import placement_group

        free = ray_private.available_resources_per_node()
        node = node_to_grow_on(free, self.per_worker)
        if node is None:
            return
        pg = placement_group(
            [self.per_worker],
            strategy="STRICT_PACK",
            name=f"{self._namespace}{growth_tag(self.reservation)}{uuid.uuid4().hex[:8]}",
            bundle_label_selector=[{"ray.io/node-id": node}],
        )
        if pg.wait(_PLACE_S):
            self._grown.append((pg, node))
            logger.info("trial %s grew into one more worker's room on node %s", self.reservation[:8], node[:8])
        else:  # another trial or task took the room first
            _remove(pg)

    def __repr__(self) -> str:
        return f"TrialSlots(reservation={self.reservation[:8]}, most_workers={self.most_workers})"


def _remove(pg: Any) -> None:
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(pg)
    except Exception:  # noqa: BLE001 - already gone
        pass
