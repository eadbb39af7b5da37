"""`chorus up` as a supervisor sees it: SIGTERM stops every service it started, and a `chorus up`
killed outright (SIGKILL, OOM) takes its services with it instead of leaving them serving."""

import os
import signal
import subprocess
import sys
import time

import pytest

from chorus.processes import child_pids

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


def _descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        for child in child_pids(todo.pop()):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _start_up() -> tuple[subprocess.Popen, set[int]]:
    proc = subprocess.Popen([sys.executable, "-m", "chorus.cli", "up", "--port", "0", "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    lines = []
    deadline = time.monotonic() + 240
    for line in proc.stdout:
        lines.append(line)
        if "Chorus is up" in line:
            break
        assert time.monotonic() < deadline, "".join(lines)
    else:
        pytest.fail("chorus up exited before it was up:\n" + "".join(lines))
    services = _descendants(proc.pid)
    assert len(services) >= 4, services  # worker, vocoder, scheduler core and its frontend
    return proc, services


def _wait_gone(pids: set[int], timeout: float) -> set[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    return {p for p in pids if _alive(p)}


def test_sigterm_stops_every_service():
    proc, services = _start_up()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(90) == 0
    assert not _wait_gone(services, 30)


def test_a_killed_chorus_up_takes_its_services_with_it():
    proc, services = _start_up()
    proc.kill()
    proc.wait(10)
    assert not _wait_gone(services, 90)
