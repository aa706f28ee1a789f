"""Elastic state: `State` (the base class) and `ObjectState`."""

from ray_elastic.state.state import ObjectState, State

__all__ = ["ObjectState", "State"]
