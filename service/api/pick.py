"""Which of a model's artifacts a host should load, and why every other one lost (GET /v1/refs/{ref}/pick).

The host says what it is (its concrete target, from compiler.device or compiler.targets.detect_cpu_target, and its
torch version); the pick filters every stored artifact of the version's model by target, toolchain and shapes, and
takes the exact target first, then a compatible one (code for a lower ISA level runs on a higher one: a v3 package
on a v4 host). Old CPU labels compare as the level they stand for (compiler.targets.ALIASES), and a package built
under one (-march=native, `cachekey.pinned`) is never picked, as lookup never serves one. Among compatible
targets the highest wins: the one every other compatible one could run on. Within a target, lookup.rank's order
(static before dynamic, narrowest range, fastest measured, newest). A build not yet run on its target
(compiler.ontarget: built on another level or architecture, not countersigned) loses to every build that ran on its
target, and is picked at all only when the host asks (allow_unverified), with the reason saying so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from compiler import cachekey, ontarget
from compiler import shapes as specs
from compiler.targets import Target
from service.api.lookup import rank


@dataclass
class Picked:
    artifact: dict[str, Any] | None
    match: str = ""  # exact | compatible
    reason: str = ""
    rejected: list[dict[str, Any]] = field(default_factory=list)


def _why_not(a: dict[str, Any], host: Target, torch: str | None, spec: list[dict[str, Any]] | None,
             allow_unverified: bool = False, training: bool = False) -> list[str]:
    f = a["factors"]
    why: list[str] = []
    step = (f.get("options") or {}).get("mode") == "training"
    if step and not training and a.get("package", True):
        why.append("a train step (mode=training): load it with Client.load_training")
    elif training and not step:
        why.append("not a train step: Client.load_training takes a mode=training package")
    built = Target.parse(f["target"])
    if (no := built.cannot_run_on(host)) is not None:
        why.append(f"target: {no}")
    theirs = (f.get("toolchain") or {}).get("torch")
    if torch and theirs and theirs != torch:
        why.append(f"toolchain: built with torch {theirs}; this host has torch {torch}")
    if spec is not None and not specs.covers(f["spec"], [i["shape"] for i in spec]):
        why.append(f"shapes: it serves {specs.format_spec(f['spec'])}; asked for {specs.format_spec(spec)}")
    if not a.get("package", True):
        why.append("a report only (mode=training): no package to load")
    if not cachekey.bounded(f):
        why.append("built before today's bounds checks; only its own key reaches it")
    if not cachekey.pinned(f):
        why.append("built before x86-64 levels, with -march=native: it may use an extension this host lacks; "
                   "only its own key reaches it (compile it again for its level)")
    if not ontarget.servable(a, allow_unverified):
        why.append(ontarget.why_not(a))
    return why


def _target(a: dict[str, Any]) -> str:
    """An artifact's target as compiler.targets names it now (an old label, `cpu-x86_64-avx2`, is its level)."""
    return str(Target.parse(a["factors"]["target"]))


def _highest(targets: list[str]) -> str:
    """Of compatible targets, the one all the others could run on (the highest level), else the first by name."""
    for t in sorted(targets):
        if all(Target.parse(u).cannot_run_on(Target.parse(t)) is None for u in targets):
            return t
    return sorted(targets)[0]


def pick(artifacts: list[dict[str, Any]], host: Target, *, torch: str | None = None,
         spec: list[dict[str, Any]] | None = None, allow_unverified: bool = False,
         training: bool = False) -> Picked:
    """The artifact for `host` among `artifacts` (one model's), with a reason, and every other with why it lost.
    `allow_unverified`: a build not yet run on its target (compiler.ontarget) may be picked, after every one that
    ran on its target, and the reason says so. `training`: a train step for Client.load_training, else an inference
    package."""
    fits: list[dict[str, Any]] = []
    rejected: list[dict[str, Any]] = []
    for a in sorted(artifacts, key=lambda a: (a["factors"]["target"], -a.get("created", 0))):
        why = _why_not(a, host, torch, spec, allow_unverified, training)
        (rejected.append(_entry(a, why)) if why else fits.append(a))
    if not fits:
        return Picked(None, rejected=rejected)
    fits = _on_target_first(fits, rejected)
    exact = [a for a in fits if _target(a) == str(host)]
    if exact:
        group, match = exact, "exact"
        reason = f"built for this host's target {host}"
    else:
        best = _highest(sorted({_target(a) for a in fits}))
        group, match = [a for a in fits if _target(a) == best], "compatible"
        reason = f"no build for {host}; {best} runs on it, and is the highest such target built"
    chosen = (rank(group, Target(host.kind), spec, mode="training" if training else None, allow_unverified=True)
              if spec is not None else None) or max(
        group, key=lambda a: a.get("created", 0))
    if not ontarget.ran_on_target(chosen):
        reason += f"; taken as asked (allow_unverified), though {ontarget.why_not(chosen).split(';')[0]}"
    if len(group) > 1:
        reason += f" (of {len(group)} such builds, the best ranked for these shapes: static first, then the "\
                  "narrowest range, then the fastest checked)"
    for a in fits:
        if a is not chosen:
            lost = ("another build of the same target ranked higher" if _target(a) == _target(chosen)
                    else f"{_target(chosen)} is a closer match")
            rejected.append(_entry(a, [f"not picked: {lost}"]))
    return Picked(chosen, match, reason, rejected)


def _on_target_first(fits: list[dict[str, Any]], rejected: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Where any fitting build ran on its target, the ones that did not lose (to `rejected`, saying why)."""
    ran = [a for a in fits if ontarget.ran_on_target(a)]
    if not ran or len(ran) == len(fits):
        return fits
    for a in fits:
        if not ontarget.ran_on_target(a):
            rejected.append(_entry(a, [f"not picked: {ontarget.why_not(a).split(';')[0]}, and builds that ran on "
                                       "their target fit"]))
    return ran


def _entry(a: dict[str, Any], why: list[str]) -> dict[str, Any]:
    f = a["factors"]
    return {"key": a["key"], "target": f["target"], "toolchain": f.get("toolchain") or {}, "spec": f["spec"],
            "why": why}
