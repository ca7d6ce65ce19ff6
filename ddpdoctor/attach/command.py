"""`ddpdoctor run`'s pieces that are not the CLI's parsing: what to run, a launcher run around, the end's word.

The three ways in: `ddpdoctor run [OPTIONS] SCRIPT ARGS` and `-m MODULE ARGS` run the script in this process
(attach/script.py), as one rank under torchrun or srun, or as the parent of its own ranks (mp.spawn);
`ddpdoctor run [OPTIONS] -- COMMAND ARGS` starts a launcher (torchrun, accelerate launch, `python train.py`)
whose Python processes attach through the environment (attach/settings.py, _site/sitecustomize.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ddpdoctor.attach.script import Target
from ddpdoctor.attach.settings import RunSettings
from ddpdoctor.core.errors import UsageError


@dataclass(frozen=True)
class Split:
    """The command line after `run`: ddpdoctor's options, then a script, a module or a command."""

    options: list[str]
    target: Optional[Target] = None
    command: Optional[list[str]] = None


def split(tokens: Sequence[str], takes_value: set[str]) -> Split:
    """Options come first; the first other word is the script (everything after it is the script's), `-m NAME`
    a module, `--` a command. `takes_value`: the options whose value is the next word."""
    options: list[str] = []
    i = 0
    while i < len(tokens):
        word = tokens[i]
        if word == "--":
            command = list(tokens[i + 1:])
            if not command:
                raise UsageError("nothing after `--`: give the command to run, e.g. -- torchrun --nproc_per_node=2 "
                                 "train.py")
            return Split(options, command=command)
        if word == "-m" or (word.startswith("-m") and not word.startswith("--")):
            name = word[2:] or (tokens[i + 1] if i + 1 < len(tokens) else "")
            if not name:
                raise UsageError("-m needs a module name: ddpdoctor run -m package.train ARGS")
            rest = tokens[i + 1:] if word[2:] else tokens[i + 2:]
            return Split(options, target=Target(module=name, args=tuple(rest)))
        if word.startswith("-") and word != "-":
            options.append(word)
            if word in takes_value:
                if i + 1 >= len(tokens):
                    raise UsageError(f"{word} needs a value")
                options.append(tokens[i + 1])
                i += 1
            i += 1
            continue
        return Split(options, target=Target(path=word, args=tuple(tokens[i + 1:])))
    return Split(options)


def absolute(options: dict[str, Any]) -> dict[str, Any]:
    """Paths made absolute: the ranks a launcher starts may run from another folder."""
    out = dict(options)
    for key in ("json_path", "history", "tensorboard", "trace_path", "html_path"):
        if isinstance(out.get(key), str):
            out[key] = os.path.abspath(out[key])
    return out


def run_around(command: list[str], settings: RunSettings) -> int:
    """Start `command` with the settings in its environment and wait for it; its exit status (a signal's death as
    a shell reports it, 128 + the signal). Ctrl-C reaches it from the terminal (it is in our process group), so
    here it is ignored; SIGTERM and SIGHUP sent to us are passed on."""
    env = settings.environment(dict(os.environ))
    try:
        proc = subprocess.Popen(command, env=env)
    except FileNotFoundError:
        raise UsageError(f"command {command[0]!r} not found: give a launcher on PATH (torchrun, accelerate, python) "
                         "or its full path") from None
    except PermissionError:
        raise UsageError(f"command {command[0]!r} is not executable") from None
    forwarded = (signal.SIGTERM, signal.SIGHUP)
    before = {s: signal.getsignal(s) for s in (*forwarded, signal.SIGINT)}
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for sig in forwarded:
        signal.signal(sig, lambda signum, frame: proc.send_signal(signum))
    try:
        status = proc.wait()
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    return status if status >= 0 else 128 - status


def speaks(env: Optional[dict[str, str]] = None) -> bool:
    """Whether this process says the run's last word: the job's rank 0, or a run with no rank of its own."""
    env = dict(os.environ) if env is None else env
    rank = env.get("RANK", env.get("SLURM_PROCID", "0"))
    return rank.strip() in ("", "0")


UNATTACHED = ("ddpdoctor run: nothing was watched: no DistributedDataParallel (or FSDP) model was built, and no "
              "Lightning or Hugging Face Trainer, in any Python process of this run; the script ran as it would "
              "without ddpdoctor. Is it a DDP job? (docs/callback.md, `ddpdoctor run`)")


def report_unattached(settings: RunSettings, json_path: Optional[str], status: int) -> bool:
    """The end's one line where nothing attached anywhere in the run, and the JSON all the same; True if said."""
    if settings.attached_anywhere() or not speaks():
        return False
    sys.stderr.write(UNATTACHED + "\n")
    if json_path and not os.path.exists(json_path):
        report = {"attached": False, "why": UNATTACHED.split(": ", 1)[1], "exit_status": status, "steps": 0,
                  "findings": []}
        try:
            with open(json_path, "w") as f:
                json.dump(report, f, indent=2)
        except OSError as exc:
            sys.stderr.write(f"ddpdoctor run: could not write {json_path}: {exc}\n")
    return True
