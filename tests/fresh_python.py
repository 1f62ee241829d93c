"""Code run in a fresh interpreter: what a test must see from a clean process (which modules an
import pulls in, first-use costs) rather than from the test run's own, already warm one."""

from __future__ import annotations

import subprocess
import sys


def run_python(code: str, timeout: float = 300) -> str:
    """Run `code` with this interpreter (`python -c`); its stdout. Fails the test, with the
    tail of its stderr, if it does not exit 0."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout
