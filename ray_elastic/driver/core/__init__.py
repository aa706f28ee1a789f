"""The driver's pure core: messages in, actions out, no Ray and no waiting.

`driver_core.DriverCore` composes the parts (generations, finishing,
failures, broken rings, scaling, the pace watch) over one shared
`run_record.RunRecord`; `phase.py` owns the run's phase and the one function
that changes it; `policies.py` and `stragglers.py` are the pure judgement
calls; `messages.py` is what crosses between the core and its shell.
Every module here is tested without Ray, by replaying message scripts.
"""
