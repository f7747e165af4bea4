"""`deepcompile plan`: step time, throughput and memory of a model on a cluster we don't have,
from profiles we can take here (see plan.py for the pipeline and the assumed figures).

    shapes.py      model shapes (built-ins, Hugging Face config.json)
    pieces.py      the embedding, one decoder layer and the head, built fake or for real
    trace.py       their forward/backward graphs (AOTAutograd, min-cut partitioner)
    roofline.py    a node's FLOPs, bytes and time on a target GPU (fused like Inductor, or eager)
    host.py        a host profile (CPU, gloo ranks), measured by benchmarks/validation
    compose.py     the full model's graphs and the step's live-bytes curve
    network.py     collective times at N x G ranks (NCCL ring/tree; gloo measured)
    schedule.py    what schedules share: sizes, persistent state, the optimizer step
    ours_model.py  deepcompile's plan of a step and its items (memory, time)
    ours_passes.py the passes, planned at scale by their own planners
    ours.py        deepcompile's schedule: the plan's items as simulator events
    peers.py       FSDP2's and DeepSpeed ZeRO-3's schedules
    simulate.py    host, compute and communication lanes, memory over one step
    report.py      table, JSON, picture
"""

from .plan import PlanArgs, PlanError, make_plan

__all__ = ["PlanArgs", "PlanError", "make_plan"]
