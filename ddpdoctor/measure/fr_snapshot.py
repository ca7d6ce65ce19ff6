"""This rank's own Flight Recorder, read live: torch's record of the collectives it issued.

Our collective marks say which op a rank was in; torch's recorder adds what only the
backend saw (tensor shapes and dtypes of every call, sequence numbers per process group),
so a shape or dtype disagreement is found without a barrier before every collective.
It is on by default in recent torch (2000 entries); TORCH_FR_BUFFER_SIZE=0 turns it off
and then this says so. Stacks are not dumped: they cost seconds and we have our own.
"""

from __future__ import annotations

from typing import Any

KEEP = ("collective_seq_id", "profiling_name", "process_group", "input_sizes", "input_dtypes", "output_sizes",
        "state", "is_p2p")


OFF_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


def take(limit: int = 64) -> dict[str, Any]:
    """The last `limit` collectives of each process group, as JSON-able entries, or why not.

    NCCL keeps its own recorder (CUDA events), read by `_dump_nccl_trace`; gloo's is read by
    `_dump_fr_trace`. An empty recorder is "off" only when a variable set it to 0.
    """
    import os

    off = [f"{v}=0" for v in OFF_VARS if os.environ.get(v, "").strip() == "0"]
    try:
        import torch
        import torch.distributed as dist

        c10d = torch._C._distributed_c10d
        nccl = dist.is_initialized() and dist.get_backend() == "nccl"
        dump = getattr(c10d, "_dump_nccl_trace" if nccl else "_dump_fr_trace", None)
        if dump is None:
            return {"unknown": f"torch {torch.__version__} has no Flight Recorder for this backend", "off": True}
        from ddpdoctor.judge.flight_recorder import loads_plain

        data = loads_plain(dump(includeStackTraces=False))
    except Exception as exc:  # a diagnostic must never fail the rank that asked for it
        return {"unknown": f"{type(exc).__name__}: {exc}"}
    if not isinstance(data, dict):
        return {"unknown": f"an unexpected Flight Recorder dump ({type(data).__name__})"}
    entries = [e for e in (data.get("entries") or []) if isinstance(e, dict) and not e.get("is_p2p")]
    if not entries:
        if off:
            return {"unknown": f"the Flight Recorder is turned off ({', '.join(off)})", "off": True}
        return {"unknown": "the Flight Recorder holds no collective yet"}
    by_group: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        pg = e.get("process_group")
        by_group.setdefault(str(pg[0]) if isinstance(pg, (list, tuple)) and pg else "0", []).append(e)
    kept = [{k: e.get(k) for k in KEEP} for group in by_group.values() for e in group[-limit:]]  # JSON makes tuples lists
    return {"version": str(data.get("version", "")), "entries": kept}

