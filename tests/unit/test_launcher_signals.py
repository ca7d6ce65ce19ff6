"""A signal to the launcher while it imports torch is held until the import is over."""

from __future__ import annotations

import os
import signal

import pytest

from ddpdoctor.session import launcher


def test_a_signal_inside_a_guarded_section_is_raised_when_it_ends():
    launcher._signalled.clear()
    launcher._deferred.clear()
    previous = signal.signal(signal.SIGINT, launcher._raise_interrupted)
    finished = []
    try:
        with pytest.raises(launcher._Interrupted) as raised:
            with launcher._SignalsAfter():
                os.kill(os.getpid(), signal.SIGINT)
                finished.append("the section ran to its end")  # not cut in the middle
        assert raised.value.name == "SIGINT" and finished
    finally:
        signal.signal(signal.SIGINT, previous)
        launcher._signalled.clear()
        launcher._deferred.clear()


def test_outside_a_guarded_section_the_signal_raises_at_once():
    launcher._signalled.clear()
    previous = signal.signal(signal.SIGTERM, launcher._raise_interrupted)
    try:
        with pytest.raises(launcher._Interrupted):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs at the next bytecode boundary
                pass
            raise AssertionError("not interrupted")
    finally:
        signal.signal(signal.SIGTERM, previous)
        launcher._signalled.clear()
