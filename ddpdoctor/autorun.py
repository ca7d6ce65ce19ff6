"""`ddpdoctor run` inside a process: the attachment (ddpdoctor/attach/) given the Doctor and the adapters.

Called by `ddpdoctor run` for the script it runs in its own process, and by `_site/sitecustomize.py` in every
Python process started under it. It lives at the top because it joins rooms that must not know each other:
the attachment, the Doctor with its summary screen (render/), and the Trainers' adapters.
"""

from __future__ import annotations

from typing import Any, Optional

from ddpdoctor.attach import install as _install
from ddpdoctor.attach.settings import RunSettings


def start(settings: Optional[RunSettings] = None) -> Optional[Any]:
    """Attach in this process (once); None where no `ddpdoctor run` asked for it."""
    settings = settings if settings is not None else RunSettings.from_environment()
    if settings is None:
        return None
    return _install.install(settings, _doctor, _lightning, _hf)


def finish() -> None:
    """The script ended in this process: its Doctor's end of the run, if one attached and still runs."""
    attacher = _install.current()
    if attacher is not None:
        attacher.close()


def _doctor(model: Any, **options: Any) -> Any:
    import ddpdoctor

    return ddpdoctor._doctor_module().Doctor(model, **options)  # with the run summary's screen


def _lightning(**options: Any) -> Any:
    from ddpdoctor.adapters import lightning_callback

    return lightning_callback(**options)


def _hf(**options: Any) -> Any:
    from ddpdoctor.adapters import hf_callback

    return hf_callback(**options)
