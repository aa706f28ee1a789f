"""The run's driver, in two halves: a pure core that decides (`core/`) and the Ray shell that carries out (`shell/`).

The actor itself, the asyncio loop that joins them, is `ray_elastic/driver_actor.py`.
"""
