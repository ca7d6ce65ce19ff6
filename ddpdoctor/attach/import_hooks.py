"""Run a function when a module has been imported: torch, Lightning, transformers, without importing them.

Why not import them: `ddpdoctor run` starts in every Python process a launcher makes (torchrun's agent, a
data-preparation subprocess), and most never import Lightning or transformers; importing torch alone costs
seconds. A finder on `sys.meta_path` lets the import happen as the script asks for it, and calls the function
once the module's code has run (the way wrapt's post-import hooks do).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from types import ModuleType
from typing import Any, Callable, Optional, Sequence

log = logging.getLogger("ddpdoctor")

_WAITING: dict[str, list[Callable[[ModuleType], None]]] = {}
_LOCK = threading.Lock()


def when_imported(name: str, fn: Callable[[ModuleType], None]) -> None:
    """`fn(module)` once `name` is imported: now if it already is, else right after its import ends."""
    module = sys.modules.get(name)
    if module is not None and not _importing(module):
        _call(fn, module)
        return
    with _LOCK:
        _WAITING.setdefault(name, []).append(fn)
        if not any(isinstance(f, _Finder) for f in sys.meta_path):
            sys.meta_path.insert(0, _Finder())


def _importing(module: ModuleType) -> bool:
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def _call(fn: Callable[[ModuleType], None], module: ModuleType) -> None:
    try:
        fn(module)
    except Exception:  # a framework's version we do not know: the script runs on, unwatched there
        log.warning("ddpdoctor run: could not attach to %s", module.__name__, exc_info=True)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module someone waits on, it wraps the real loader's exec_module."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Any = None) -> Any:
        if fullname not in _WAITING:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module") or isinstance(loader, _After):
            return spec
        spec.loader = _After(loader, fullname)
        return spec


class _After(importlib.abc.Loader):
    """The real loader, then the waiting functions."""

    def __init__(self, loader: Any, name: str) -> None:
        self.loader, self.name = loader, name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        with _LOCK:
            waiting = _WAITING.pop(self.name, [])
        for fn in waiting:
            _call(fn, module)

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, get_filename...
        return getattr(self.loader, name)
