"""ddpdoctor: diagnose PyTorch DistributedDataParallel jobs.

Importing the package must stay cheap: the CLI imports torch only where a
command needs it, so `ddpdoctor --help` and bad-argument errors are instant.
"""

from typing import Optional

__version__ = "0.1.0"


def __getattr__(name: str):  # `ddpdoctor.Doctor` without importing torch for the CLI
    if name in ("Doctor", "FindingRaised"):
        return getattr(_doctor_module(), name)
    if name in ("adapters", "api"):
        import importlib

        return importlib.import_module(f"ddpdoctor.{name}")
    if name == "watch":
        from ddpdoctor.callback.watch import watch

        return watch
    raise AttributeError(f"module 'ddpdoctor' has no attribute {name!r}")


def _doctor_module():
    """callback/doctor.py, with the run summary's screen (render/, a room above it) plugged in."""
    from ddpdoctor.callback import doctor
    from ddpdoctor.render.run_summary import print_summary

    if doctor.SUMMARY_PRINTER is None:
        doctor.SUMMARY_PRINTER = print_summary
    if doctor.HTML_WRITER is None:
        doctor.HTML_WRITER = _write_page
    return doctor


def _write_page(path: str, data: dict, timeline: Optional[dict]) -> str:
    """The Doctor's `html_path` page (render/html_report.py), imported only when one is written."""
    from ddpdoctor.render import html_report

    return html_report.write(path, "doctor", data, timeline)
