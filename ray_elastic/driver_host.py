"""The class Ray hosts for the run's driver: a thin one, so that a worker's boot does not load the driver.

Ray imports an actor's class in every process that unpickles a handle to it,
and every worker is handed the driver's handle (to tell it what happens).
Were that class `driver_actor.DriverActor`, each newcomer's boot would import
the driver's core, its shell and Ray's autoscaler SDK for nothing: 0.1 s on a
quiet machine, 0.26 s in `bench/boot_phases.py`'s scale-ups, on the critical
path of every replacement. `DriverHost` imports the driver only in its own
process, when Ray constructs it, and hands each call to the `DriverActor` it
holds; its module imports nothing of the driver.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ray

from ray_elastic.auth import Authed, RunToken, with_token_check

if TYPE_CHECKING:
    from ray_elastic.config import RunConfig
    from ray_elastic.driver_actor import DriverActor
    from ray_elastic.protocol import DriverStatus, RunOutcome
    from ray_elastic.wire import ToldMessage


class DriverHost:
    """Wrapped by `ray.remote` in `create_driver_actor`; each public method is `DriverActor`'s (see there)."""

    _run_token: RunToken  # the run's token, set by `with_token_check` (auth.py) before __init__ runs

    def __init__(self, run_id: str, namespace: str, config: RunConfig) -> None:
        """Plain values only, which Ray keeps with the actor for its restarts."""
        from ray_elastic.driver_actor import DriverActor

        self._driver: DriverActor = DriverActor(self._run_token, run_id, namespace, config)

    async def run(self) -> RunOutcome:
        return await self._driver.run()

    async def tell(self, message: ToldMessage) -> None:
        await self._driver.tell(message)

    async def add_metrics(
        self, worker_id: str, batch: list[tuple[float, dict]], seq: int | None = None, paces: list | None = None
    ) -> None:
        await self._driver.add_metrics(worker_id, batch, seq, paces)

    async def stop(self, reason: str = "stopped by the user") -> None:
        await self._driver.stop(reason)

    async def status(self, metrics_since: int = 0, events_since: int = 0) -> DriverStatus:
        return await self._driver.status(metrics_since, events_since)


def create_driver_actor(
    run_id: str,
    namespace: str,
    token: RunToken,
    payload: bytes,
    discovery: bytes | str | None,  # a pickled callable, or a script's path
    config: RunConfig,
    scheduling_strategy: Any = None,
) -> Any:
    """Start the run's driver actor, named `driver` in the run's namespace; it answers only calls carrying `token`."""
    from ray_elastic.driver.shell import snapshot

    # restarted by Ray when it dies, and sent again the calls it had not answered (fit()'s run() among them)
    cls = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(with_token_check(DriverHost))
    # the payload and discovery wait in the GCS, signed, not in the object store under this process's ownership
    snapshot.save_start(run_id, token, payload, discovery)
    handle = cls.options(
        name="driver", namespace=namespace, max_concurrency=1000, scheduling_strategy=scheduling_strategy
    ).remote(token, run_id, namespace, config)
    return Authed(handle, token)
