"""Lightning callbacks, one per file; :class:`~parallelkit.callbacks.base.ParallelKitCallback` is their base."""
