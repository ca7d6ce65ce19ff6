"""Every exit code ddpdoctor's processes use, and the one place that leaves a process at once.

Why one module: a launcher, torchrun's summary, Slurm and a job script all read these codes,
and the run diagnosis reads them back (124 is "our own deadline fired", 86 "the injected crash");
defined twice, they drift apart. `hard_exit` is the only caller of `os._exit` in the package:
it is how a rank leaves without interpreter teardown (which with torch loaded can itself hang
on a broken backend) once everything it knows is published and flushed.

| code | meaning |
|---|---|
| 0, 1, 2, 3 | the verdict, Nagios plugin convention: OK, WARNING, CRITICAL, UNKNOWN |
| 86 | a rank crashed on purpose (`--inject crash`) |
| 93 | `explain --exit-code requeue`: do not retry (nvidia-resiliency-ext's no-restart code; permanent under Kubeflow) |
| 94 | `explain --exit-code requeue`: unknown whether a retry helps (permanent under Kubeflow) |
| 123 | `Doctor(on_hang="exit")`: a step hung and this rank only waited for the rank named as its cause (docs/callback.md) |
| 124 | a stage deadline fired (as coreutils' timeout(1)); `Doctor(on_hang="exit")`: this rank caused a hang, it leaves first |
| 125 | a rank outlived its launcher or lost the out-of-band store |
| 200 | `explain --exit-code requeue`: retry (128-255 is retryable under Kubeflow; above every 128+signal) |
"""

from __future__ import annotations

import os
from typing import NoReturn

EXIT_OK = 0
EXIT_WARNING = 1
EXIT_CRITICAL = 2
EXIT_UNKNOWN = 3
INJECTED_CRASH_EXIT = 86
PEER_HUNG_EXIT = 123
STAGE_TIMEOUT_EXIT = 124
ORPHANED_EXIT = 125
# `ddpdoctor explain --exit-code requeue`: what a job script or an operator acts on (docs/explain.md).
REQUEUE_NO_RETRY_EXIT = 93
REQUEUE_UNKNOWN_EXIT = 94
REQUEUE_RETRY_EXIT = 200


def hard_exit(code: int) -> NoReturn:
    """Leave now: no atexit handlers, no interpreter teardown, and no flush either (a caller
    that printed flushes first: a flush into a full pipe nobody reads would block the exit)."""
    os._exit(code)
