"""What a worker's boot imports of ours: the runtime it runs, not the driver or the trainer.

Ray imports an actor's class in every process that unpickles a handle to it,
and every worker unpickles the driver's handle; a worker also imports the
package to run `train_fn`. Had either path loaded the driver (its core, its
shell, Ray's autoscaler SDK) or the trainer, every newcomer's boot, on the
critical path of a replacement, would pay for modules it never uses.
"""

from __future__ import annotations

import subprocess
import sys

from ray_elastic.driver_host import DriverHost

_NOT_IN_A_WORKER = (
    "ray_elastic.driver_actor",
    "ray_elastic.driver.core.driver_core",
    "ray_elastic.driver.shell",
    "ray_elastic.trainer",
    "ray_elastic.teardown",
    "ray.autoscaler.sdk",
)


def test_a_workers_imports_and_the_drivers_hosted_class_load_nothing_of_the_driver_or_the_trainer():
    code = (
        "import sys, pickle\n"
        "import ray_elastic, ray_elastic.worker_actor, ray_elastic.torch\n"
        "from ray_elastic.driver_host import DriverHost\n"  # what unpickling the driver's handle imports
        f"print([m for m in {_NOT_IN_A_WORKER!r} if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", f"a worker's boot loads {out.stdout.strip()}"


def test_the_hosted_class_answers_every_call_the_driver_takes():
    from ray_elastic.driver_actor import DriverActor

    hosted = {name for name in vars(DriverHost) if not name.startswith("_")}
    public = {name for name in vars(DriverActor) if not name.startswith("_")}
    assert hosted == public, f"calls the host does not pass on: {public - hosted}; extra: {hosted - public}"


def test_the_public_names_of_the_package_still_include_the_trainer():
    import ray_elastic

    assert ray_elastic.ElasticTrainer.__name__ == "ElasticTrainer" and ray_elastic.Result.__name__ == "Result"
    assert {"ElasticTrainer", "Result"} <= set(ray_elastic.__all__)
