"""One attachment per process: installed once, from `ddpdoctor run` itself or from sitecustomize in a child."""

from __future__ import annotations

from typing import Any, Callable, Optional

from ddpdoctor.attach import frameworks
from ddpdoctor.attach.import_hooks import when_imported
from ddpdoctor.attach.settings import RunSettings
from ddpdoctor.attach.step_hooks import Attacher, MakeDoctor

_ATTACHER: Optional[Attacher] = None


def install(settings: RunSettings, make_doctor: MakeDoctor, lightning: Callable[..., Any],
            hf: Callable[..., Any]) -> Attacher:
    """The process's attachment (made once; a second call returns the first): torch's hooks wait for torch's
    import, the Trainers' for theirs, so a process that never trains pays an import hook and nothing else."""
    global _ATTACHER
    if _ATTACHER is None:
        attacher = Attacher(settings, make_doctor)
        when_imported("torch", attacher.on_torch)
        when_imported("torch.distributed.fsdp.fully_sharded_data_parallel", attacher.on_fsdp)
        frameworks.install(attacher, lightning, hf)
        _ATTACHER = attacher
    return _ATTACHER


def current() -> Optional[Attacher]:
    return _ATTACHER
