"""Pipeline runtime: executes split programs under schedules, in one process or under torchrun.

Its rooms, by concern (imports point down this list, never up):

- :mod:`pipesplit.runtime.engine`: the step engine (``Pipeline``, the rank workers, executors, traces);
- :mod:`pipesplit.runtime.state`: what a step keeps and saves (checkpoints, optimizer state);
- :mod:`pipesplit.runtime.comm`: what crosses between ranks (transports, collectives);
- :mod:`pipesplit.runtime.graphs`: compiled code (compiled stages, F/I/W graphs, CUDA graphs).
"""

from pipesplit.deprecation import moved_modules
from pipesplit.runtime.engine.pipeline import Pipeline
from pipesplit.runtime.engine.trace import ActionRecord, Trace

__all__ = ["ActionRecord", "Pipeline", "Trace"]

MOVED = {f"pipesplit.runtime.{name}": f"pipesplit.runtime.{room}.{name}" for room, names in {
    "engine": ("pipeline", "worker", "steps", "threads", "trace", "microbatch", "options", "loss_leaves",
               "weight_grads", "measure"),
    "graphs": ("compiled", "stage_graphs", "stage_parts", "cuda_graphs", "compile_limits"),
    "comm": ("distributed", "transport", "rendezvous", "exchange", "collectives", "running_stats", "grad_edges"),
    "state": ("checkpoint", "optim_state", "state_writes"),
}.items() for name in names}
"""The runtime's modules before it was grouped into rooms (0.2): old path -> new path, each importable
under its old path, with a DeprecationWarning, until 0.3."""

moved_modules(MOVED)
