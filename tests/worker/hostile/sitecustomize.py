"""Hostile code in a sandboxed child, for tests/worker/test_sandbox_bounds.py: on the PYTHONPATH of the sandbox, Python
imports this at start, before `python -m worker.child JOBDIR KIND` runs. When JOBDIR holds hostile.py (the test's
plan, written by the trusted test), it runs that in place of the child and exits: what it does goes to stdout, the
child's log, in lines `HOSTILE {json}`."""

import os
import sys

if len(sys.argv) >= 3 and os.path.isfile(os.path.join(sys.argv[-2], "hostile.py")):
    _plan = os.path.join(sys.argv[-2], "hostile.py")
    _code = compile(open(_plan).read(), _plan, "exec")
    try:
        exec(_code, {"__name__": "hostile", "JOBDIR": sys.argv[-2], "KIND": sys.argv[-1]})
    finally:
        sys.stdout.flush()
        os._exit(3)
