"""A framework's Trainer, recognised when it is built, gets the adapter it has (ddpdoctor/adapters.py).

Lightning and the Hugging Face Trainer run their own loop: the batch and loss come to their callbacks
(Lightning) or through the model (Hugging Face), and they run collectives of their own between steps
that the adapters time as waiting. So where a script builds one, its constructor is wrapped to add the
adapter's callback (unless the script added one itself), and the plain loop's attachment
(attach/step_hooks.py) stands down in this process. The adapters are made by the caller (the package's
top, which may import them): this room only knows where they go.
"""

from __future__ import annotations

from typing import Any, Callable

from ddpdoctor.attach.import_hooks import when_imported
from ddpdoctor.attach.step_hooks import Attacher

ADAPTER_NAMES = ("DoctorCallback", "DoctorTrainerCallback")  # ddpdoctor.adapters' classes


def install(attacher: Attacher, lightning: Callable[..., Any], hf: Callable[..., Any]) -> None:
    """Wrap the Trainers' constructors when (if ever) their modules are imported."""
    for name in ("lightning.pytorch", "pytorch_lightning"):
        when_imported(name, lambda module: _wrap(module.Trainer, "lightning", attacher, lightning, _add_lightning))
    when_imported("transformers.trainer",
                  lambda module: _wrap(module.Trainer, "hf", attacher, hf, lambda trainer, cb: trainer.add_callback(cb)))


def _add_lightning(trainer: Any, callback: Any) -> None:
    trainer.callbacks.append(callback)


def _wrap(cls: type, framework: str, attacher: Attacher, factory: Callable[..., Any],
          add: Callable[[Any, Any], None]) -> None:
    def built(trainer: Any) -> None:
        attacher.framework = framework  # before its DDP is built and its first step taken
        if not _has_adapter(trainer):
            add(trainer, factory(**attacher.settings.options))
            attacher.settings.mark_attached(f"the {framework} adapter")

    attacher.wrap_init(cls, built)


def _has_adapter(trainer: Any) -> bool:
    """The script added ddpdoctor's adapter itself: one Doctor is enough."""
    handler = getattr(trainer, "callback_handler", None)  # Hugging Face keeps them there
    callbacks = getattr(handler, "callbacks", None) if handler is not None else getattr(trainer, "callbacks", None)
    return any(type(cb).__name__ in ADAPTER_NAMES for cb in (callbacks or []))
