"""The GPUs of a torch.nn.DataParallel model (one process, several GPUs), measured over its first steps.

Apart from `Doctor`'s step flow because it is a different kind of job: no process group, no
gather, only this process's own GPUs read through NVML, then judged once by
`online_checks.data_parallel_finding`. Every other model reads nothing here.
"""

from __future__ import annotations

from typing import Any, Optional

from ddpdoctor.callback.online_checks import DataParallelGpu

# A DataParallel model's GPUs are measured over this many steps (or `every`, if fewer), then judged.
DATA_PARALLEL_STEPS = 20


def data_parallel_ids(model: Any) -> Optional[list[int]]:
    """The GPUs of a torch.nn.DataParallel model (possibly empty: no GPU), or None for any other model."""
    import torch

    inner = getattr(model, "_orig_mod", model)
    if not isinstance(inner, torch.nn.DataParallel):
        return None
    return [int(getattr(d, "index", d)) for d in (inner.device_ids or [])]


class DataParallelGpus:
    """Each GPU's utilisation, sampled once a step, and its peak memory when judged."""

    def __init__(self, model: Any) -> None:
        self.ids = data_parallel_ids(model)  # None: not a DataParallel model
        self.util: dict[int, list[float]] = {i: [] for i in self.ids or []}

    def sample(self) -> None:
        if not self.ids:
            return
        import torch

        from ddpdoctor.measure import nvml

        for index in self.ids:
            uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
            handle = nvml.query("nvmlDeviceGetHandleByUUID", f"GPU-{uuid}") if uuid else nvml.Unknown("no uuid")
            if isinstance(handle, nvml.Unknown):
                continue
            util = nvml.query("nvmlDeviceGetUtilizationRates", handle, convert=lambda u: float(u.gpu))
            if not isinstance(util, nvml.Unknown):
                self.util[index].append(util)

    def gpus(self) -> list[DataParallelGpu]:
        """What was measured, with each GPU's peak memory read now (0 where it cannot be read)."""
        gpus = []
        for index in self.ids or []:
            try:
                import torch

                peak = int(torch.cuda.max_memory_allocated(index))
            except Exception:
                peak = 0
            gpus.append(DataParallelGpu(index=index, peak_mem_bytes=peak, util_pct=self.util.get(index, [])))
        return gpus
