"""Starting and stopping the standalone launcher's local ranks: plain subprocesses.

Each rank runs `python -m ddpdoctor ...` in a session of its own (so a signal to the
terminal's process group reaches the launcher only, and the launcher decides), with its
stdout and stderr in files. They are started before the launcher imports torch: importing
torch takes about 2 s of one core, and the ranks import it themselves, so doing both at
once takes 2 s off every run (the pre-flight budget is 2x a bare torchrun).
Stopping is SIGTERM to each rank's process group, then SIGKILL after a grace period.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


class RankProcesses:
    def __init__(self) -> None:
        self.procs: dict[int, subprocess.Popen] = {}
        self.stderrs: dict[int, str] = {}

    def start(self, argv: list[str], envs: dict[int, dict[str, str]], log_root: str,
              without: tuple[str, ...] = ()) -> None:
        """Rank by rank; the caller holds this object first, so whatever started is stopped. `without`: variables
        of this environment the ranks do not inherit (a crash tried again without a setting)."""
        inherited = {k: v for k, v in os.environ.items() if k not in without}
        try:
            for rank, extra in sorted(envs.items()):
                folder = os.path.join(log_root, str(rank))
                os.makedirs(folder, exist_ok=True)
                self.stderrs[rank] = os.path.join(folder, "stderr.log")
                with open(os.path.join(folder, "stdout.log"), "wb") as out, open(self.stderrs[rank], "wb") as err:
                    self.procs[rank] = subprocess.Popen(
                        [sys.executable, "-m", "ddpdoctor", *argv], env={**inherited, **extra},
                        stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
        except BaseException:
            self.close(grace_s=0.0)  # a rank that started must not outlive a failed start of the next
            raise

    def close(self, grace_s: float) -> None:
        """SIGTERM every rank still running, SIGKILL the ones still there after `grace_s`."""
        alive = [p for p in self.procs.values() if p.poll() is None]
        for proc in alive:
            _signal_group(proc, signal.SIGTERM)
        end = time.monotonic() + grace_s
        for proc in alive:
            try:
                proc.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in alive:
            if proc.poll() is None:
                _signal_group(proc, signal.SIGKILL)
                try:
                    proc.wait(timeout=3.0)
                except subprocess.TimeoutExpired:
                    pass  # stuck in the kernel (D state): recorded as still running


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the rank's session: its own children (DataLoader workers) too
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass
