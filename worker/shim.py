"""The exec shim around a compile or check child's sandbox (worker.isolation), in two places:

    python -I -S worker/shim.py [--cgroup PROCS]... [--uid U --gid G] -- bwrap ...
    python -I -S worker/shim.py [--uid U --gid G] [--no-new-privs] [--as B] [--cpu S] [--fsize B] [--nproc N]
                                [--nofile N] -- CMD...

Outside, as the launcher: it writes its own pid into each cgroup.procs file (the sandbox's cgroup, worker.cgroups),
so bwrap and all it starts are counted from their first instruction, then drops to the uid if asked (userns mode)
and execs bwrap. Inside, the first program to run in the sandbox: it sets the rlimits (worker.limits), drops to the
sandbox's uid where the sandbox leaves that to it (setgroups, setgid, setuid: from root to another uid, which clears
every capability), sets no_new_privs if asked (bwrap already has), and execs CMD. So no `preexec_fn` runs in the
worker's forked, threaded process, and nothing an upload shaped runs before the limits hold. It runs with `-I -S`
(no PYTHONPATH, no site) and imports only os, sys and resource: about 20 ms.
"""

import os
import resource
import sys

CPU_GRACE_S = 10  # SIGXCPU at the soft CPU limit; SIGKILL this much later (the hard limit)
PR_SET_NO_NEW_PRIVS = 38
RLIMITS = {"--as": resource.RLIMIT_AS, "--cpu": resource.RLIMIT_CPU, "--fsize": resource.RLIMIT_FSIZE,
           "--nproc": resource.RLIMIT_NPROC, "--nofile": resource.RLIMIT_NOFILE}


def _set(which: int, value: int) -> None:
    soft = value
    hard = value + CPU_GRACE_S if which == resource.RLIMIT_CPU else value
    try:
        resource.setrlimit(which, (soft, hard))
    except (ValueError, OSError):  # not allowed to raise the hard limit (not root): stay within it
        _, cur_hard = resource.getrlimit(which)
        if cur_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, cur_hard), min(hard, cur_hard)
        resource.setrlimit(which, (soft, hard))


def main(argv: list[str]) -> None:
    if "--" not in argv:
        sys.exit(__doc__)
    cut = argv.index("--")
    opts, cmd = argv[:cut], argv[cut + 1:]
    flags = {o for o in opts if o == "--no-new-privs"}
    pairs = [o for o in opts if o not in flags]
    values = dict(zip(pairs[::2], pairs[1::2]))
    for flag, value in zip(pairs[::2], pairs[1::2]):
        if flag == "--cgroup":  # one per controller hierarchy (cgroup v1), or the one group (v2)
            with open(value, "w") as f:
                f.write(str(os.getpid()))
    for flag, value in values.items():  # still root where the sandbox drops privileges here: hard limits can rise
        if flag in RLIMITS:
            _set(RLIMITS[flag], int(value))
    if "--uid" in values:
        os.setgroups([])
        os.setgid(int(values["--gid"]))
        os.setuid(int(values["--uid"]))
        if 0 in (os.getuid(), os.geteuid(), os.getgid(), os.getegid()):
            sys.exit("shim.py: still root after dropping to the sandbox uid")
    if flags:
        import ctypes

        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            sys.exit("shim.py: prctl(PR_SET_NO_NEW_PRIVS) failed")
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
