"""A worker's torch threads follow the CPUs reserved for it (the rule, without Ray).

Ray sets `OMP_NUM_THREADS` to the CPUs an actor asks of Ray, and to 1 when
it asks for none, as a trial's workers do (they run on the trial's
reservation): torch then ran one thread on a reservation of several CPUs.
integration/test_worker_threads_cluster.py checks real workers, in and outside Tune trials.
"""

from __future__ import annotations

from ray_elastic.runtime.threads import intra_op_threads, ray_default_threads


def test_the_threads_are_the_reserved_cpus_unless_the_user_set_them():
    # a trial's worker: Ray saw no CPU request and set 1; 2 CPUs are reserved for it
    assert intra_op_threads(2.0, env_value="1", ray_default=ray_default_threads(None)) == 2
    assert intra_op_threads(2.5, env_value=None, ray_default=1) == 2
    assert intra_op_threads(0.5, env_value="1", ray_default=1) == 1, "a fraction of a CPU still runs one thread"
    assert intra_op_threads(4.0, env_value="3", ray_default=1) is None, "a value Ray would not set is the user's"
    assert intra_op_threads(4.0, env_value="1", ray_default=1, user_set=True) is None
    assert ray_default_threads(3.7) == 3 and ray_default_threads(0.0) == 1
