"""The seccomp filter of compile and check children: what a compile never needs and an attacker would reach for
fails with EPERM, in both sandbox modes (bwrap loads it with `--seccomp FD` just before it execs the child, after
its own mounts; every process the child starts inherits it and cannot drop it).

Refused: new namespaces (unshare, setns, and clone with any CLONE_NEW* flag; clone3 answers ENOSYS instead, since
its flags sit in memory a filter cannot read, and glibc then falls back to clone), mounting (mount, umount2,
pivot_root, chroot and the new mount API), reading or writing other processes (ptrace, process_vm_readv/writev,
pidfd_getfd), bpf, perf_event_open, userfaultfd, the kernel keyring, io_uring, open_by_handle_at, kexec and module
loading, and a few host-wide knobs (swap, accounting, quotas, the clock, reboot, syslog). Everything else is allowed:
a deny-list, since torch, g++, ld, OpenMP and Triton use a wide and changing set of calls. A system call of another
architecture (32-bit calls from a 64-bit child) kills the process: libseccomp's default for a foreign arch.

Built once at start from pyseccomp (ctypes over libseccomp.so.2) into BPF bytes; each child gets a fresh memfd.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

DENIED = (
    "unshare", "setns",
    "mount", "umount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount",
    "fspick", "mount_setattr",
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd",
    "bpf", "perf_event_open", "userfaultfd",
    "keyctl", "add_key", "request_key",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "open_by_handle_at", "name_to_handle_at",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "swapon", "swapoff", "acct", "quotactl", "quotactl_fd", "reboot", "syslog", "vhangup", "lookup_dcookie",
    "iopl", "ioperm", "settimeofday", "clock_settime", "clock_adjtime", "fanotify_init", "nfsservctl",
)
CLONE_NEW = {  # clone(2)'s flags (its first argument on every arch this runs on); CLONE_NEWTIME only via clone3
    "CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}


class SeccompUnavailable(RuntimeError):
    """No filter can be built here (no pyseccomp, no libseccomp.so.2)."""


@dataclass(frozen=True)
class Filter:
    bpf: bytes
    denied: tuple[str, ...]  # the names this libseccomp knew (others do not exist on this arch or library)

    def fd(self) -> int:
        """A fresh fd holding the program, at offset 0, for `bwrap --seccomp FD` (bwrap reads it to the end)."""
        fd = os.memfd_create("aotc-seccomp", 0)
        try:
            os.write(fd, self.bpf)
            os.lseek(fd, 0, os.SEEK_SET)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def describe(self) -> str:
        return (f"seccomp: EPERM for {len(self.denied)} system calls (namespaces, mount, ptrace, bpf, keyctl, "
                "io_uring, kexec, modules...) and clone with CLONE_NEW*; ENOSYS for clone3")


def build() -> Filter:
    """The filter, as BPF; SeccompUnavailable says why it cannot be built."""
    try:
        import pyseccomp as sc
    except (ImportError, RuntimeError, OSError) as e:  # RuntimeError: pyseccomp found no libseccomp
        raise SeccompUnavailable(f"no seccomp filter: {e}. Install libseccomp2 (apt-get install libseccomp2) and "
                                 "the worker's dependencies (pip install 'aotc[worker]')") from None
    f = sc.SyscallFilter(defaction=sc.ALLOW)
    eperm = sc.ERRNO(errno.EPERM)
    denied = []
    for name in DENIED:
        if sc.resolve_syscall(sc.Arch.NATIVE, name) == -1:  # __NR_SCMP_ERROR: this libseccomp does not know it
            continue
        f.add_rule(eperm, name)
        denied.append(name)
    for flag in CLONE_NEW.values():
        f.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    with os.fdopen(os.memfd_create("aotc-seccomp-build", 0), "w+b") as out:
        f.export_bpf(out)
        out.seek(0)
        bpf = out.read()
    return Filter(bpf, tuple(denied))
