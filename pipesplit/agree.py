"""One plan on every rank: processes that each compile the model adopt global rank 0's plan.

Planning by measured time (``cost="profile"``/``"hybrid"``, a ``schedule``'s step time at
the device's measured rates, ``refine=``) reads clocks, and clocks differ between processes:
on 2 loaded CPU cores, 4 ranks compiling the same GPT chose different cuts about 1 run in 3,
so rank 0 sent ``add_2`` while rank 1 waited for ``add_1`` and ``dropout_1``, and the step
hung until the timeout. Under an initialised ``torch.distributed`` world, rank 0 publishes
its plan in the process group's store and every other rank waits for it and takes it.

The store, not a collective: rank 0 never waits, so compiling on rank 0 alone (to inspect
a split) still works. Keys name the captured graph, the stage count and how many times
this process has planned that graph, so ranks pair up the same compile call.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from datetime import timedelta
from typing import Any

from pipesplit.errors import PlanError
from pipesplit.plan import Plan

PLAN_TIMEOUT_S = 900.0  # rank 0 may be profiling or refining a large model meanwhile

_calls: Counter[str] = Counter()


def graph_fingerprint(gm: Any) -> str:
    """A digest of the captured graph's nodes: equal on ranks that captured the same model."""
    text = "\n".join(f"{n.op} {n.name} {n.target} {[str(a) for a in n.all_input_nodes]}" for n in gm.graph.nodes)
    text = re.sub(r" at 0x[0-9a-fA-F]+", "", text)  # a Python function target prints its address
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def agree_on_plan(gm: Any, plan: Plan, timeout: float = PLAN_TIMEOUT_S) -> Plan:
    """``plan`` on global rank 0 (or without a multi-process world); rank 0's plan everywhere else."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return plan
    base = f"pipesplit/plan/{graph_fingerprint(gm)}/{plan.num_stages}/{plan.cost_name}/{plan.schedule}"
    _calls[base] += 1
    key = f"{base}/{_calls[base]}"
    store = dist.distributed_c10d._get_default_store()
    rank = dist.get_rank()
    if rank == 0:
        store.set(key, plan.to_json())
        return plan
    try:
        store.wait([key], timedelta(seconds=timeout))
    except Exception as e:  # the store raises on its timeout
        raise PlanError(
            f"rank {rank} waited {timeout:.0f}s for global rank 0's plan of this graph ({plan.num_stages} stages, "
            f"cost {plan.cost_name!r}, call {_calls[base]}) and it never came: under torch.distributed every rank "
            "adopts rank 0's plan, so rank 0 must compile the same model with the same num_stages, cost and "
            "schedule, as often as this rank does. Or pass the same plan= (Plan.save on one rank) everywhere."
        ) from e
    adopted = Plan.from_json(store.get(key).decode())
    adopted.source = plan.source
    return adopted
