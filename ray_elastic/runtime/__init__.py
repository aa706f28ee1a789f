"""The worker runtime, in parts with one job each; `ray_elastic.runtime.context` composes them.

- `process`: which runtime this process runs, and the activity marks its collectives leave;
- `membership`: the ready announce, joining and resetting rings, host-change notices and the
  agreement on them;
- `checkpoint_cadence`: which commits become durable checkpoints, and resuming from one;
- `metrics_shipper`: rank 0's `report()` metrics, buffered and shipped in the background.
"""
