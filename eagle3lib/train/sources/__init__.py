"""Where 02_train's states come from: the one place that reads train.source, train.online_placement and, for the
thread and the process, whether extract.backend's capture runs in an engine's interpreter (docs/design.md §8). The
rest of the stage holds a Placement and the BatchSource it opens (sources/base.py), and asks neither again.

    shards      01_extract's shards on disk (sources/shards.py)
    thread      the capture in a thread of each trainer (sources/thread.py; sglang_inprocess: in SGLang's interpreter)
    process     a capture process beside the trainers, linked by process groups of their own (sources/process.py;
                sglang_inprocess: the capture process in SGLang's interpreter, the trainers in this one)
    ray         a capture actor and trainer actors placed by Ray (sources/ray_actors.py; sglang_inprocess: the
                capture actor in SGLang's interpreter, on SGLang's --tp GPUs of one node)
"""

from __future__ import annotations

from eagle3lib.train.sources.base import BatchSource, OnlinePlacement, Placement, StageProcess, StageRun
from eagle3lib.train.sources.process import CaptureProcess, InEngineProcess
from eagle3lib.train.sources.ray_actors import InEngineRay, RayActors
from eagle3lib.train.sources.shards import FromShards
from eagle3lib.train.sources.thread import InEngineThread, InThread

__all__ = ["BatchSource", "OnlinePlacement", "Placement", "StageProcess", "StageRun", "for_params", "online_placement"]

ONLINE = {"thread": InThread, "process": CaptureProcess, "ray": RayActors}
# extract.backend sglang_inprocess: the capture is SGLang's model runner, in SGLang's interpreter
IN_ENGINE = {"thread": InEngineThread, "process": InEngineProcess, "ray": InEngineRay}


def online_placement(p) -> OnlinePlacement:
    """The placement train.source: online takes with these params (00_prepare's plan asks it of a shards run too)."""
    placements = IN_ENGINE if p.extract.backend == "sglang_inprocess" else ONLINE
    return placements[p.train.online_placement]()


def for_params(p) -> Placement:
    """The params' placement: shards, or online's."""
    return FromShards() if p.train.source == "shards" else online_placement(p)
