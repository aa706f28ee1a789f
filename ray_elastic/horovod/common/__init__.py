"""`horovod.common`'s importable names: `exceptions` and `elastic`."""
