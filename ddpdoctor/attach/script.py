"""Run a script or a module in this process as `python SCRIPT ARGS` or `python -m MODULE ARGS` would.

What the script sees must be what it sees without us: `__name__ == "__main__"`, `sys.argv` (its own path
first), `sys.path[0]` (its folder; the current folder for a module), its relative imports, and functions
defined in it picklable by mp.spawn (runpy puts the script in `sys.modules["__main__"]` while it runs, so a
spawned child imports it from its path, as it does under `python SCRIPT`). What it gives back is what the
interpreter would make of it: its exit status, a traceback that starts at its own frames.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys
import traceback
from dataclasses import dataclass
from types import TracebackType
from typing import Optional

from ddpdoctor.core.errors import UsageError

_OURS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.abspath(runpy.__file__))


@dataclass(frozen=True)
class Target:
    """What `ddpdoctor run` runs: a script's path or a module's name, and its arguments."""

    path: Optional[str] = None
    module: Optional[str] = None
    args: tuple[str, ...] = ()

    def check(self) -> None:
        """A target that cannot run is a usage error now, not a traceback from inside runpy."""
        if self.path is not None:
            if os.path.isdir(self.path) and not os.path.exists(os.path.join(self.path, "__main__.py")):
                raise UsageError(f"{self.path!r} is a folder with no __main__.py: give the training script")
            if not os.path.exists(self.path):
                raise UsageError(f"script {self.path!r} not found (from {os.getcwd()!r}): give the training "
                                 "script's path, or -m MODULE, or -- COMMAND to run a launcher")
        elif self.module is not None:
            try:
                found = importlib.util.find_spec(self.module)
            except (ImportError, ValueError):
                found = None
            if found is None:
                raise UsageError(f"no module named {self.module!r} (sys.path[0] is the current folder, "
                                 f"{os.getcwd()!r}, as with python -m)")


def run(target: Target) -> int:
    """Run it; its exit status (SystemExit's code, 1 for an uncaught exception with its traceback on stderr).
    KeyboardInterrupt is not caught: the caller ends the run first, then lets it end the process."""
    saved_argv, saved_path0 = sys.argv, sys.path[0] if sys.path else None
    try:
        if target.module is not None:
            sys.argv = [target.module, *target.args]  # runpy puts the module's file there (alter_sys)
            _set_path0(os.getcwd())
            runpy.run_module(target.module, run_name="__main__", alter_sys=True)
        else:
            assert target.path is not None
            sys.argv = [target.path, *target.args]
            _set_path0(os.path.dirname(os.path.abspath(target.path)) if not os.path.isdir(target.path)
                       else os.path.abspath(target.path))
            runpy.run_path(target.path, run_name="__main__")
        return 0
    except SystemExit as exc:
        return exit_status(exc.code)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # the script's own error: as the interpreter prints it
        print_traceback(exc)
        return 1
    finally:
        sys.argv = saved_argv
        if saved_path0 is not None:
            _set_path0(saved_path0)


def _set_path0(folder: str) -> None:
    if sys.path:
        sys.path[0] = folder
    else:
        sys.path.insert(0, folder)


def exit_status(code: object) -> int:
    """SystemExit's code as the interpreter turns it into a status: None 0, an int itself, else printed and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    sys.stderr.write(f"{code}\n")
    return 1


def print_traceback(exc: BaseException) -> None:
    """The traceback from the script's first frame: ours (the CLI, runpy) are not the user's."""
    sys.stderr.write("".join(traceback.format_exception(type(exc), exc, trimmed(exc.__traceback__))))
    sys.stderr.flush()


def trimmed(tb: Optional[TracebackType]) -> Optional[TracebackType]:
    """`tb` without its leading frames in ddpdoctor or runpy (never empty: the last frame stays)."""
    while tb is not None and tb.tb_next is not None and _ours(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def _ours(filename: str) -> bool:
    return filename.startswith("<frozen runpy") or os.path.abspath(filename).startswith(_OURS)
