"""File operations on a mount, each in a child process of its own under a hard timeout.

A fault test asks how long an operation takes to fail. Run in the test's own process, an
operation that the daemon never answers would hang the test in the kernel, beyond any
signal: a FUSE request the daemon has taken is waited for uninterruptibly (state D). In a
child it is reported as hung after the timeout and left behind (killed, it ends when its
daemon answers or its connection is aborted: the test's teardown stops the daemon).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# Each operation takes a path and an optional second argument; it prints nothing itself.
OPERATIONS = {
    "stat": "os.stat(path)",
    "mkdir": "os.mkdir(path)",
    "create": "open(path, 'xb').write(b'x' * 4096)",
    "overwrite": "open(path, 'wb').write(b'y' * 4096)",
    "publish": "open(path + '.tmp', 'xb').write(b'z' * 4096); os.rename(path + '.tmp', path)",  # as vLLM stores
    "read": "open(path, 'rb').read()",
    "access": "if not os.access(path, os.R_OK): raise OSError(errno.ENOENT, 'access')",
    "listdir": "os.listdir(path)",
}

_CHILD = """
import errno, json, os, sys, time
path = sys.argv[1]
started = time.monotonic()
try:
    {operation}
    outcome = "ok"
except OSError as error:
    outcome = errno.errorcode.get(error.errno, str(error.errno))
print(json.dumps({{"outcome": outcome, "seconds": time.monotonic() - started}}))
"""


@dataclass(frozen=True)
class Outcome:
    operation: str
    path: Path
    result: str  # "ok", an errno's name (EIO, ENOENT...), or "hung"
    seconds: float  # how long the operation took in the child (the hard timeout if it hung)

    def __str__(self) -> str:
        return f"{self.operation} {self.path.name}: {self.result} after {self.seconds:.2f} s"


def run(operation: str, path: Path, timeout: float) -> Outcome:
    """One operation on `path`, killed after `timeout` seconds (then "hung")."""
    code = _CHILD.format(operation=OPERATIONS[operation])
    child = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()  # (not waited for: it may be in D state until its daemon goes)
        return Outcome(operation, path, "hung", timeout)
    if child.returncode != 0:
        raise AssertionError(f"{operation} {path}: the child failed: {stderr[-2000:]}")
    answer = json.loads(stdout)
    return Outcome(operation, path, answer["outcome"], answer["seconds"])
