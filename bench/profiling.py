"""Profiling a benchmark's server process with py-spy (``--py-spy FILE`` of the benchmarks).

py-spy is not a dependency of Tributary: install it by hand (``.venv/bin/pip install py-spy``)
to use the option. The output is py-spy's "raw" format (collapsed stacks, one line a stack
with its sample count), for flamegraph.pl or speedscope.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path


def _py_spy() -> str:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else "py-spy"


def start_py_spy(pid: int | None, output: str | None) -> subprocess.Popen[bytes] | None:
    """Start ``py-spy record`` of process ``pid`` into ``output`` (None: do nothing). It samples
    only the thread holding the GIL, so the profile shows CPU, not threads waiting on I/O."""
    if output is None or pid is None:
        return None
    spy = subprocess.Popen([_py_spy(), "record", "--pid", str(pid), "--rate", "250", "--format", "raw",
                            "--output", output, "--nonblocking", "--gil"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # let it attach
    return spy


def stop_py_spy(spy: subprocess.Popen[bytes] | None, output: str | None) -> None:
    """Stop the recording; py-spy writes its file as it exits."""
    if spy is None:
        return
    spy.send_signal(signal.SIGINT)
    spy.wait(timeout=60)
    print(f"  py-spy profile written to {output}")
