"""One error tree for aotc. Torch-free: the API, the worker, the compiler and the client all import it.

    AotcError                      status, code, message: a request the API refuses
     ├── BadRequest        400     malformed request that is not a validation error
     ├── NotFound          404     unknown model, job or artifact
     ├── Conflict          409     e.g. cancelling a job that already ended
     ├── PayloadTooLarge   413     upload over the size limit
     ├── UnsupportedMedia  415     upload that is not a zip
     ├── Unprocessable     422     a spec or an archive that contradicts the exported program
     │    └── UnsafeArchive        an archive that holds what a normal model never needs
     └── Unavailable       503     no live worker for a target; Redis down

    CompileError                   stage, message, excerpt: a compile or check that failed (final)
     ├── UnsafeModel               an archive whose pickled parts would not load with weights_only=True
     ├── BadModel                  not an exported program torch can read, or one this service refuses
     ├── SpecError                 the requested shapes contradict the exported program
     ├── UnsafeCode                the generated code calls what no kernel calls (system, exec*, dlopen, sockets,
     │                             inline asm, a header off the allow-list): refused before anything ran it
     ├── IsaMismatch               a CPU package that uses an instruction set above its target's x86-64 level
     │                             (compiler.isa): refused before it is checked or published
     └── CheckFailed               the artifact ran but disagrees with eager beyond tolerance

    BadSignature                   reason, kid: an artifact whose signed manifest does not verify (the client
                                   refuses to write or load it): unsigned, malformed, unknown_key, revoked_key,
                                   bad_signature, mismatch (key, sha256 or size), trusted_keys (unreadable pins),
                                   unverified_on_target (built for a target it did not run on, and no trusted
                                   countersignature: compiler/ontarget.py)

Every message says what was wrong and, where it can, what would be right: a user's mistake is never a 500.
A CompileError on a valid model is permanent: retrying gives the same answer. Crashes, timeouts and lost
workers are not exceptions: each failed attempt becomes a `Failure` record.

    Failure                        type, message, stage, excerpt; retryable follows from the type
      Timeout, Crashed, OutOfMemory, WorkerLost, WorkerError    retryable: the machine failed, not the model
      BrokenEnvironment            a child that failed before its compile started: the worker hands the job back
                                   without spending an attempt, and stops claiming after a few in a row
      DiskFull                     ENOSPC in the worker or a child (work dir, caches, outputs, publish): the worker
                                   hands the job back without spending an attempt (at most max_attempts times;
                                   then it is charged like any retryable failure) and claims nothing while its
                                   disks are below AOTC_DISK_LOW_WATER_MB
      DeviceLost                   a child that failed after its work started, where a fresh child then could not
                                   use the device (a GPU that fell off the bus): handed back once without spending
                                   an attempt, and the worker is unhealthy until its device answers; a second one
                                   under the same job fails it, final (the job likely breaks devices)
      Cancelled, ToolchainMismatch, NotFound, any CompileError  final
    A job that has used its attempts fails with its last failure's type, marked not retryable.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any


class AotcError(Exception):
    status = 500
    code = "internal"

    def __init__(self, message: str, **detail: Any) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail

    def to_json(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message, **self.detail}}


class BadRequest(AotcError):
    status, code = 400, "bad_request"


class NotFound(AotcError):
    status, code = 404, "not_found"


class Conflict(AotcError):
    status, code = 409, "conflict"


class PayloadTooLarge(AotcError):
    status, code = 413, "too_large"


class UnsupportedMedia(AotcError):
    status, code = 415, "not_a_zip"


class Unprocessable(AotcError):
    status, code = 422, "invalid"


class UnsafeArchive(Unprocessable):
    code = "unsafe_archive"


class Unavailable(AotcError):
    status, code = 503, "unavailable"


class Unauthorized(AotcError):
    """No API key, or one the service does not know (or has revoked)."""

    status, code = 401, "unauthorized"
    headers = {"WWW-Authenticate": "Bearer"}


class Forbidden(AotcError):
    """A known key whose scope does not allow the request."""

    status, code = 403, "forbidden"


class TooManyJobs(AotcError):
    """A namespace has as many queued and running jobs as its quota allows."""

    status, code = 429, "quota_jobs"
    headers = {"Retry-After": "30"}


class OverQuota(AotcError):
    """A namespace's stored bytes would pass its quota."""

    status, code = 507, "quota_storage"


class CompileError(Exception):
    def __init__(self, message: str, *, stage: str = "", excerpt: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.stage = stage
        self.excerpt = excerpt


# What of a failure reaches the job record: the message and the excerpt are cut at these (worker.sandbox, for what a
# child reports).
MESSAGE_MAX = 4000
EXCERPT_MAX = 8000


def _chain(e: BaseException) -> list[BaseException]:
    """`e` and what it wraps: Inductor's `inner_exception`, then the cause or context, without cycles."""
    seen: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and all(cur is not s for s in seen) and len(seen) < 16:
        seen.append(cur)
        inner = getattr(cur, "inner_exception", None)
        cur = inner if isinstance(inner, BaseException) else (cur.__cause__ or cur.__context__)
    return seen


def first_line(e: BaseException, limit: int = 200) -> str:
    """`Type: the first line of its message` (at most `limit` characters of it), or the type alone."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:limit]}" if text else type(e).__name__


def described(e: BaseException) -> tuple[str, str]:
    """(message, excerpt) of an exception a compile stage raised. A C++ compile error of generated code leads with
    the compiler's own error lines: torch's message puts the whole command first, then every note of the compiler,
    and the job's message is cut at MESSAGE_MAX (LeViT-128's first `error:` came 94,698 characters in). The
    compiler's output goes to the excerpt: whole where it fits EXCERPT_MAX, else each error line with the three
    after it (or the tail, where no line says error)."""
    cpp = next((x for x in _chain(e) if type(x).__name__ == "CppCompileError"), None)
    output = getattr(cpp, "output", None)
    if not isinstance(output, str):
        return f"{type(e).__name__}: {e}", ""
    every = output.splitlines()
    at = [i for i, line in enumerate(every) if ": error: " in line]
    lines = list(dict.fromkeys(re.sub(r"^\S*/", "", every[i].strip()) for i in at))
    first = "; ".join(lines[:3]) if lines else "no line says error (the output is in the excerpt)"
    more = f" (and {len(lines) - 3} more)" if len(lines) > 3 else ""
    message = f"{type(e).__name__}: C++ compile error in the generated code: {first}{more}"
    if len(output) <= EXCERPT_MAX:
        return message, output
    if not at:
        return message, "...\n" + output[-EXCERPT_MAX:]
    near = "\n".join(every[i] for i in sorted({j for i in at[:10] for j in range(i, min(i + 4, len(every)))}))
    return message, near[:EXCERPT_MAX]


class UnsafeModel(CompileError):
    pass


class BadModel(CompileError):
    pass


class SpecError(CompileError):
    pass


class UnsafeCode(CompileError):
    pass


class IsaMismatch(CompileError):
    pass


class CheckFailed(CompileError):
    pass


class BadSignature(Exception):
    """A signed artifact manifest (compiler/signing.py) that does not verify, or a package that does not match it.
    `reason` is one word (unsigned, malformed, unknown_key, revoked_key, bad_signature, mismatch, trusted_keys,
    unverified_on_target);
    `kid` the signing key concerned, where there is one; the message says what failed."""

    def __init__(self, reason: str, message: str, *, kid: str = "") -> None:
        super().__init__(message)
        self.reason, self.message, self.kid = reason, message, kid


# Failure kinds that another attempt may fix: the machine or the process failed, not the model. Everything else
# (a CompileError, a cancel, a toolchain mismatch, an unexpected exception in the compile) is final.
RETRYABLE = frozenset({"Timeout", "Crashed", "OutOfMemory", "WorkerLost", "WorkerError", "BrokenEnvironment",
                       "DiskFull", "DeviceLost"})


@dataclass(frozen=True)
class Failure:
    """Why one attempt at a job failed, as job records, events and the API carry it.

    JSON: {"type", "message", "stage", "excerpt", "retryable", ...extra}. Every failure record is built here, and
    whether a retry could help is decided here, from the type.
    """

    type: str
    message: str
    stage: str = ""
    excerpt: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    retry: bool | None = None  # None: as the type says; False for a job that has used its attempts

    @property
    def retryable(self) -> bool:
        return self.type in RETRYABLE if self.retry is None else self.retry

    def to_json(self) -> dict[str, Any]:
        return {**self.extra, "type": self.type, "message": self.message, "stage": self.stage,
                "excerpt": self.excerpt, "retryable": self.retryable}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Failure:
        known = {"type", "message", "stage", "excerpt", "retryable"}
        retry = d.get("retryable")
        return cls(str(d.get("type") or "Error"), str(d.get("message") or ""), str(d.get("stage") or ""),
                   str(d.get("excerpt") or ""), {k: v for k, v in d.items() if k not in known},
                   None if not isinstance(retry, bool) or retry == (d.get("type") in RETRYABLE) else retry)

    @classmethod
    def from_exception(cls, e: BaseException, stage: str, excerpt: str = "") -> Failure:
        """A compile or check that raised: a CompileError keeps its own stage and excerpt; out of memory anywhere
        in the cause chain is worth another attempt (maybe on another worker); anything else is final."""
        if isinstance(e, CompileError):
            f = cls(type(e).__name__, e.message, e.stage or stage, e.excerpt)
        else:
            f = cls(type(e).__name__, str(e), stage, excerpt)
        if _out_of_memory(e):
            f = cls("OutOfMemory", f"{stage} ran out of memory: {f.message}", f.stage, f.excerpt)
        return f

    @classmethod
    def timeout(cls, stage: str, seconds: float, excerpt: str = "") -> Failure:
        return cls("Timeout", f"{stage} timed out after {seconds:g} s and was killed", stage, excerpt)

    @classmethod
    def crashed(cls, stage: str, message: str, excerpt: str = "", signal: int | None = None) -> Failure:
        return cls("Crashed", message, stage, excerpt, {"signal": signal})

    @classmethod
    def cancelled(cls, message: str, stage: str = "") -> Failure:
        return cls("Cancelled", message, stage)

    @classmethod
    def worker_lost(cls, worker: str, stage: str, lease_s: float) -> Failure:
        return cls("WorkerLost", f"worker lost: {worker} stopped renewing its lease during {stage} "
                   f"(no heartbeat for {lease_s:g} s; killed, crashed or cut off from Redis)", stage,
                   extra={"worker": worker})

    @classmethod
    def worker_error(cls, e: BaseException, stage: str) -> Failure:
        return cls("WorkerError", f"the worker failed: {type(e).__name__}: {e}", stage)

    @classmethod
    def toolchain_mismatch(cls, wanted: Any, have: Any) -> Failure:
        """A job keyed for another toolchain than the worker's: its artifact would not be what the key says."""
        return cls("ToolchainMismatch", f"job was keyed for toolchain {wanted}, but this worker runs {have}", "claim")

    @classmethod
    def not_found(cls, message: str, stage: str) -> Failure:
        """Something the job needs is gone from the store (e.g. its model, at fetch)."""
        return cls("NotFound", message, stage)

    @classmethod
    def broken_environment(cls, kind: str, cause: str, excerpt: str = "") -> Failure:
        """A compile or check child that failed before its work started (in `import torch`, at its device, or
        before Python ran): nothing of the model had run, so the worker's environment is broken, not the model.
        `cause` says what happened (the child's own error, or how it died)."""
        return cls("BrokenEnvironment", f"the {kind} child failed before the {kind} started, so this worker's "
                   f"environment is broken, not the model: {cause}", kind, excerpt)

    @classmethod
    def disk_full(cls, stage: str, cause: str, excerpt: str = "") -> Failure:
        """A compile, check or publish that ran out of disk space (`cause`: what said so): the machine's fault, not
        the job's, so the worker hands the job back with its attempt refunded (worker.job)."""
        return cls("DiskFull", f"the {stage} ran out of disk space on this worker, not through the job's fault: "
                   f"{cause}", stage, excerpt)

    @classmethod
    def device_lost(cls, kind: str, device: str, cause: str, failed: Failure) -> Failure:
        """A `kind` child that failed after its work started, after which a fresh child could not use `device`
        (`cause`: how that probe failed): the device stopped working under the job, so its failure (`failed`) says
        nothing of the model; the worker hands the job back with its attempt refunded, once (worker.job)."""
        return cls("DeviceLost", f"the {kind} failed and then a fresh child could not use {device}, so the device "
                   f"stopped working under the job, not through the job's fault: {cause}; the {kind}'s own error: "
                   f"{failed.type}: {failed.message[:500]}", kind, failed.excerpt, {"device": device})

    @classmethod
    def limit_exceeded(cls, stage: str, what: str, setting: str, excerpt: str = "") -> Failure:
        """A compile or check child that went past one of the worker's resource limits ("used more than 16 GiB of
        memory"): final, since the same compile would again; the message names the setting that allows more."""
        return cls("LimitExceeded", f"the {stage} {what}; the limit is {setting}", stage, excerpt, {"limit": setting})

    @classmethod
    def bad_output(cls, stage: str, message: str) -> Failure:
        """A child whose outputs are not what the worker asked for (another path, a link, an oversized file):
        final, and nothing of it is published."""
        return cls("BadOutput", message, stage)

    @classmethod
    def gave_up(cls, max_attempts: int, last: dict[str, Any]) -> Failure:
        """A job claimed past its attempts (odd histories, e.g. a refund racing a reaper): final, keeping the type
        and details of its last failure (`last`, an entry of the job's `failures`)."""
        f = cls.from_json({**last, "type": last.get("type") or "GaveUp"})
        return cls(f.type, f"gave up after {max_attempts} attempts; last: {last.get('message', 'worker lost')}",
                   f.stage, "", f.extra, retry=False)

def _out_of_memory(e: BaseException) -> bool:
    """MemoryError or torch's (CUDA) OutOfMemoryError anywhere in the cause chain."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, MemoryError) or type(seen).__name__ == "OutOfMemoryError":
            return True
        seen = seen.__cause__ or seen.__context__
    return False
