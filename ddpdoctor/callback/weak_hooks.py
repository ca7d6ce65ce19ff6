"""Module hooks that call a watch's method through a weak reference and never raise into the user's forward.

Why weak: a hook is stored on the user's module, and `copy.deepcopy(model)` (an EMA copy, a callback's
snapshot) or `torch.save(model)` copies or pickles its hooks with it. A hook bound to a watch would drag
the watch along, and through it the Doctor, its threads and locks (`TypeError: cannot pickle
'_thread.lock'`); a local closure cannot be pickled at all. A `WeakHook` copies and pickles as a hook
that does nothing: the copy is not the job's model, and nothing of ours is saved with it.
Why never raise: a reading of ours that fails must cost the job nothing but that reading.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional


class WeakHook:
    """A hook (any signature: forward, forward pre, with or without kwargs) calling `owner.method(*args)`
    while `owner` lives; an exception in it calls `owner.on_error()` instead of reaching the forward."""

    def __init__(self, owner: Any = None, method: str = "", on_error: Optional[str] = None) -> None:
        self._ref = weakref.ref(owner) if owner is not None else None
        self._method, self._on_error = method, on_error

    def __call__(self, *args: Any) -> None:
        target = self._ref() if self._ref is not None else None
        if target is None:
            return None
        try:
            getattr(target, self._method)(*args)
        except Exception:
            if self._on_error is not None:
                try:
                    getattr(target, self._on_error)()
                except Exception:
                    pass
        return None

    def __deepcopy__(self, memo: dict) -> WeakHook:
        return WeakHook()  # a copy of the model is not watched

    def __reduce__(self) -> tuple:
        return (WeakHook, ())  # nothing of ours is saved with the model
