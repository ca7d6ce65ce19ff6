"""`main_thread_frame`: what the watchdogs (Doctor's step deadline, watch()'s init hang) read to say
where the main thread is stuck, seen from their own helper thread."""

from __future__ import annotations

import threading

from ddpdoctor.runtime.liveness import main_thread_frame


def test_a_helper_thread_sees_the_main_threads_stack() -> None:
    seen: list[str] = []
    waiting = threading.Event()

    def look() -> None:
        frame = main_thread_frame()
        while frame is not None:  # innermost first: threading's waits, then stuck_here
            seen.append(frame.f_code.co_name)
            frame = frame.f_back
        waiting.set()

    def stuck_here() -> None:
        helper = threading.Thread(target=look)
        helper.start()
        waiting.wait(10)
        helper.join(10)

    stuck_here()
    assert "stuck_here" in seen and "look" not in seen  # the main thread's stack, not the helper's own
