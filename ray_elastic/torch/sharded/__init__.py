"""Sharded models (FSDP2) in a `TorchState`: committed shard by shard with a replica, resharded in place.

`fsdp2.py` holds FSDP2's private surface (finding sharded parameters, moving
them onto a new world's mesh); `handler.py` the state handler that commits,
rolls back and reshards them; the pure planner is `ray_elastic.state.reshard_plan`.
"""
