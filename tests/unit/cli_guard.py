"""For tests that call ddpdoctor.cli.main in-process on bad input.

Importing `no_launch` into a test module makes it autouse there: no launcher variable
leaks in, and if bad input were accepted, no rank could start.
"""

from __future__ import annotations

import os
import sys

import pytest

import ddpdoctor.session.launcher
import ddpdoctor.session.rank


@pytest.fixture(autouse=True)
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") \
                or name.startswith(("SLURM_", "DDPDOCTOR_", "TORCHELASTIC_")):
            monkeypatch.delenv(name)
    for name in ("TORCH_CPP_LOG_LEVEL", "TORCH_SHOW_CPP_STACKTRACES"):
        # main() sets these for the torch it may import; undo that after each test.
        monkeypatch.setenv(name, "placeholder")
        monkeypatch.delenv(name)

    def must_not_start(*args, **kwargs):
        raise AssertionError("bad input was accepted and ranks were about to start")

    monkeypatch.setattr(ddpdoctor.session.launcher, "run_standalone", must_not_start)
    monkeypatch.setattr(ddpdoctor.session.rank, "run_rank", must_not_start)


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The one stderr line of a usage error, checked for shape: no traceback, no stdout."""
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert captured.err.endswith("\n")
    assert lines[0].startswith("ddpdoctor: error: "), lines[0]
    assert "Traceback" not in captured.err + captured.out
    assert captured.out == ""
    return lines[0]


def assert_usage_error(capsys: pytest.CaptureFixture[str], argv: list[str], words: list[str]) -> None:
    """`ddpdoctor ARGV` exits 3 with one line naming `words`, before importing torch."""
    from ddpdoctor import cli
    from ddpdoctor.core.findings import EXIT_UNKNOWN

    before = "torch" in sys.modules
    assert cli.main(argv) == EXIT_UNKNOWN == 3
    line = one_error_line(capsys)
    for word in words:
        assert word in line, line
    if not before:
        assert "torch" not in sys.modules  # a usage error must not pay for importing torch
