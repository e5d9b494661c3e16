"""The step engine: ``Pipeline``, the rank workers that run a schedule's actions, the executors, microbatches, traces and stage timing."""
