"""Where a benchmark result came from: the source tree and the host.

On the device machine the repository copy's .git is the one the copy was made from, not the tree
the run used, so CHORUS_GIT_REV (set by whoever launched the run, e.g. a device script written from
a fresh `git rev-parse HEAD`) wins over asking git. Hosts of one kind differ too (two x2 machines
read 1,271 and 1,370 s/s at c256 with the same code), hence the CPU model beside the GPU.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def git_revision() -> dict:
    """{"revision", "dirty", "source"}: CHORUS_GIT_REV if set (source "env"), else git's HEAD and
    whether tracked files differ from it (source "git"); None where neither is known."""
    given = os.environ.get("CHORUS_GIT_REV")
    if given:
        return {"revision": given, "dirty": None, "source": "env"}
    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        if rev.returncode != 0:
            return {"revision": None, "dirty": None, "source": None}
        st = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                            capture_output=True, text=True, timeout=10)
        return {"revision": rev.stdout.strip(), "dirty": bool(st.stdout.strip()) if st.returncode == 0 else None,
                "source": "git"}
    except (OSError, subprocess.SubprocessError):
        return {"revision": None, "dirty": None, "source": None}


def cpu_model() -> str | None:
    """The host CPU's model name (Linux), or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None
