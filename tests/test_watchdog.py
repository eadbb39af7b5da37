"""chorus.watchdog: a process whose device work stops finishing ends itself."""

import threading
import time

from chorus.watchdog import StallWatchdog


def test_stall_watchdog_fires_on_the_oldest_unfinished_piece_only():
    fired: list[str] = []
    event = threading.Event()

    def on_stall(message: str) -> None:
        fired.append(message)
        event.set()

    dog = StallWatchdog(1.0, "a test step", on_stall)  # pieces of 0.05 s: room for a loaded machine's pauses
    for _ in range(5):  # pieces that finish in time: nothing happens
        dog.begin()
        time.sleep(0.05)
        dog.end()
    time.sleep(0.3)
    assert fired == []
    dog.begin()  # launched, never finished
    assert event.wait(10.0)
    assert len(fired) == 1 and "a test step has not finished" in fired[0]
    time.sleep(0.3)
    assert len(fired) == 1  # once


def test_stall_watchdog_off():
    fired: list[str] = []
    dog = StallWatchdog(0, "a test step", fired.append)
    dog.begin()  # no thread, no bookkeeping
    time.sleep(0.1)
    dog.end()
    dog.end()
    assert fired == []
