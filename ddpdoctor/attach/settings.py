"""What `ddpdoctor run` hands every process it attaches to: the Doctor's options and the run's folder.

They travel in the environment (DDPDOCTOR_RUN, JSON), because the processes that need them are started
by others: torchrun's workers, mp.spawn's children, `accelerate launch`'s. The run's folder
(DDPDOCTOR_RUN_DIR) is where each process that attached a Doctor leaves a mark, so `ddpdoctor run`
can say at the end, once, that nothing was attached anywhere.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

RUN_VAR = "DDPDOCTOR_RUN"
DIR_VAR = "DDPDOCTOR_RUN_DIR"
SITE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_site")


@dataclass(frozen=True)
class RunSettings:
    """The Doctor's options as the command line gave them (plain values: they cross processes as JSON)."""

    options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for `Doctor(...)`, already checked by callback/options.py."""
    run_dir: Optional[str] = None
    """The run's folder: `attached.<pid>` files, one per process that attached a Doctor."""

    def environment(self, base: dict[str, str]) -> dict[str, str]:
        """`base` with these settings and the site folder first on PYTHONPATH (sitecustomize.py there)."""
        env = dict(base)
        env[RUN_VAR] = json.dumps(self.options)
        if self.run_dir:
            env[DIR_VAR] = self.run_dir
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != SITE_DIR]
        env["PYTHONPATH"] = os.pathsep.join([SITE_DIR, *paths])
        return env

    @classmethod
    def from_environment(cls, env: Optional[dict[str, str]] = None) -> Optional["RunSettings"]:
        """The settings a parent `ddpdoctor run` left, or None (not under it, or unreadable: then not attached)."""
        env = dict(os.environ) if env is None else env
        text = env.get(RUN_VAR)
        if not text:
            return None
        try:
            options = json.loads(text)
        except ValueError:
            return None
        if not isinstance(options, dict):
            return None
        return cls(options=options, run_dir=env.get(DIR_VAR) or None)

    def mark_attached(self, what: str) -> None:
        """Leave this process's mark in the run's folder (best effort: a folder gone means a run ended)."""
        if not self.run_dir:
            return
        try:
            with open(os.path.join(self.run_dir, f"attached.{os.getpid()}"), "w") as f:
                f.write(what)
        except OSError:
            pass

    def attached_anywhere(self) -> list[str]:
        """What each process that attached wrote (the model it found), from the run's folder."""
        if not self.run_dir or not os.path.isdir(self.run_dir):
            return []
        out = []
        for name in sorted(os.listdir(self.run_dir)):
            if name.startswith("attached."):
                try:
                    with open(os.path.join(self.run_dir, name)) as f:
                        out.append(f.read())
                except OSError:
                    continue
        return out
