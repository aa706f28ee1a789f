"""The run's driver: a pure core (`core.py`, `policies.py`, `messages.py`) and its Ray shell (`actor.py`)."""
