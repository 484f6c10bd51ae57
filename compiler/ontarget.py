"""Whether an artifact's package ran on its own target: the "built, not run on target" mark and what ends it.

A worker builds for a target it does not serve natively when AOTC_BUILD_ONLY_TARGETS names it: a lower CPU level
on a higher host today, an older GPU architecture once the toolchain can emit it (torch >= 2.14's multi-arch
kernels). Its check runs on its own device, not on the target, so it publishes the artifact marked, in the record
and in the signed manifest (compiler.signing: `on_target: {"run": false, "built_on": ...}`), and queues a verify
job for the target. A worker that serves the target natively runs the check there and countersigns.

The record's `on_target` (torch-free: the API, the worker and the client read it):

    absent                                   the builder served the target natively; its check ran there
    {"state": "unverified", "built_on": T}   built (and checked) on T, not yet on the target
    {"state": "verified", "built_on": T, "by": KID, "checked_on": target, "worker": ID, "at": t}
                                             a native worker's check passed, and its key countersigned
    {"state": "failed", "built_on": T, "worker": ID, "at": t, "why": message}
                                             the check on the target failed: never served

The record is what Redis says; a client that pins keys believes the signed mark and the countersignature instead
(client/verify.py), so whoever can write the record can only refuse more, never vouch.
"""

from __future__ import annotations

from typing import Any

NATIVE, UNVERIFIED, VERIFIED, FAILED = "native", "unverified", "verified", "failed"


def state(record: dict[str, Any]) -> str:
    """native, unverified, verified or failed (an unreadable mark reads as unverified: it vouches for nothing)."""
    mark = record.get("on_target")
    if mark is None:
        return NATIVE
    found = mark.get("state") if isinstance(mark, dict) else None
    return found if found in (VERIFIED, FAILED) else UNVERIFIED


def ran_on_target(record: dict[str, Any]) -> bool:
    return state(record) in (NATIVE, VERIFIED)


def servable(record: dict[str, Any], allow_unverified: bool = False) -> bool:
    """Whether lookup and the pick may hand this artifact over: one that ran on its target; with
    `allow_unverified`, one not yet run there too; never one whose check failed there."""
    found = state(record)
    return found in (NATIVE, VERIFIED) or (allow_unverified and found == UNVERIFIED)


def why_not(record: dict[str, Any]) -> str:
    """Why an artifact that did not run on its target is not served, for a 404's candidates and the pick's log."""
    mark = _mark(record)
    target = (record.get("factors") or {}).get("target") or record.get("target")
    built_on = str(mark.get("built_on") or "another target")[:64]
    if state(record) == FAILED:
        return f"built on {built_on}; its check failed on {target}: {str(mark.get('why') or '')[:300]}"
    return (f"built, not run on target: built and checked on {built_on}, not yet on {target} (a worker that serves "
            f"{target} countersigns it once its check passes there); ask with allow_unverified=true "
            "(--allow-unverified) to take it before then")


def describe(record: dict[str, Any]) -> str:
    """One line for `aotc report` and listings."""
    mark = _mark(record)
    found = state(record)
    if found == NATIVE:
        return "checked on target by its builder"
    if found == VERIFIED:
        return (f"built on {mark.get('built_on')}, checked on {mark.get('checked_on')} and countersigned by key "
                f"{mark.get('by')}")
    return why_not(record)


def _mark(record: dict[str, Any]) -> dict[str, Any]:
    mark = record.get("on_target")
    return mark if isinstance(mark, dict) else {}


def prefer(records: list[dict[str, Any]], allow_unverified: bool = False) -> list[dict[str, Any]]:
    """Of `records`, those that may be served, and of those the ones that ran on their target where any did: an
    unverified build is served only when asked for, and then only where no verified one fits as well."""
    allowed = [a for a in records if servable(a, allow_unverified)]
    return [a for a in allowed if ran_on_target(a)] or allowed
