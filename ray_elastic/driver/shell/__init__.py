"""The driver's Ray side: what carries out the core's actions and turns what happens in the cluster into messages.

The worker actors and their placement groups (`worker_pool.py`), liveness
rounds and node CPU probes (`liveness.py`, `cpu_probe.py`), what the cluster
says (`cluster_facts.py`), the KV actor (`kv_link.py`), the snapshot in the
GCS and calls answered once it holds them (`snapshot.py`, `durability.py`),
the inbox the loop takes batches from (`inbox.py`), the autoscaler share,
and the metrics `fit()` has not fetched (`metrics_log.py`). Every wait here
is bounded, and each module's docstring names its bound.
"""
