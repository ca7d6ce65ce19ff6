"""`ddpdoctor snapshot --out PATH` where no file can be written: one line naming PATH, exit 3.

/proc is the case os.access gets wrong for root (it says writable), which once ended in
"internal error: FileNotFoundError" after the snapshot had been measured.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ddpdoctor.core.errors import UsageError
from ddpdoctor.snapshot import write_snapshot

from .cli_guard import assert_usage_error, no_launch  # noqa: F401  (no_launch is autouse)

needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="no /proc on this system")


@pytest.mark.parametrize("case", [pytest.param("proc", marks=needs_proc), "missing folder", "folder"])
def test_unwritable_out_is_one_line_and_exit_3(capsys, tmp_path, case):
    path, words = {
        "proc": ("/proc/x", ["writable"]),  # root: cannot create a file in /proc; others: not writable
        "missing folder": (str(tmp_path / "missing" / "s.json"), ["does not exist"]),
        "folder": (str(tmp_path), ["is a folder", "give a file path"]),
    }[case]
    assert_usage_error(capsys, ["snapshot", "--no-measure", "--out", path], [f"--out {path}", *words])


@needs_proc
def test_proc_out_from_the_shell():
    done = subprocess.run([sys.executable, "-m", "ddpdoctor", "snapshot", "--no-measure", "--out", "/proc/x"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3 and done.stdout == "", done
    assert done.stderr.startswith("ddpdoctor: error: --out /proc/x") and done.stderr.count("\n") == 1, done.stderr
    assert "internal error" not in done.stderr and "Traceback" not in done.stderr


@needs_proc
def test_write_that_fails_after_measuring_is_a_usage_error():
    """The folder can change while the snapshot is measured: the write itself answers in one line."""
    with pytest.raises(UsageError, match="^/proc/x: cannot write the snapshot .*give --out a path"):
        write_snapshot({"host": "h"}, "/proc/x")
