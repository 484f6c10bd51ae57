"""The artifact check's adversarial half: what an attacker would feed the package, run where a crash costs nothing.

For every integer input, every float input the program casts to an integer and every bool input it indexes by
(compiler.inputs.index_inputs), the check tries boundaries and out-of-range values, or a mask all set and all clear
(compiler.inputs.adversarial_cases), at the smallest shape point, whatever the uploader's samples held. Each case
must end the same way in eager and in the package: if eager raises, the package must not return (it raises, or the
process it runs in dies: Inductor's index asserts throw from inside an OpenMP region on a CPU, which ends the
process, and are device-side asserts on CUDA, which end the context); if eager returns, the package must return the
same values (non-finite values in the same places are accepted here, and, where a value such as int64's largest
drives the computation to the edge of its dtype's range, a disagreement on where it overflows: BEYOND_RANGE). A
package that faults (SIGSEGV or SIGBUS; an illegal memory access on CUDA) has read or written out of bounds, and
fails whatever eager did.

Where it runs. The package never runs in the check's own process for these cases: each run happens in a probe
child, which writes one line per case as it goes. Probes are forked from a zygote that has imported torch (Zygote),
or started as `python -m compiler.adversarial` where it cannot start. The check decides first, with eager on a
CPU copy of the program, which cases raise (on CUDA an out-of-range index in eager is a device-side assert too), the
copy bounded where eager ATen is not (compiler.bounds: embedding_bag's middle offsets, which its kernel reads
wherever they point), running again for each case only the nodes its poisoned input reaches (partial_verdicts), and
hands the probe the cases that return first and those that raise last. A probe that
dies mid-case is read from its lines: the case it was in is marked, and a new probe goes on from the next one. On
CUDA a probe also leaves, to be replaced, as soon as a case has left its context unusable, so every case runs on a
working device. Where the CPU copy raises at in-range inputs too (an op with no CPU kernel), eager runs on the
device instead, inside the probe.

Cost: at most `MAX_CASES` cases (a fixed count: 26 for one integer input), at the smallest shape point. One probe
process runs them all where the package raises cleanly; one more starts after each case that ends a probe (a CPU
kernel whose assert fires inside an OpenMP region, which compiler.ranges now forestalls for the indices it covers;
every refused case on CUDA). A probe that only has refused cases
left loads the package alone, not the program. On CUDA the refused cases are dealt to up to `CUDA_LANES` lanes
of probes that run side by side (run_probe_lanes). Each probe is given `PROBE_TIMEOUT_S`, and none starts after
`BUDGET_S`: the cases left then are recorded as not run (the summary's `outcomes` counts them). A case whose package
ended in CUDA's "unspecified launch failure", which a context reset under a shared GPU answers as well as a fault,
runs again after the lanes (AMBIGUOUS_FAULT): at most AMBIGUOUS_CASES cases, AMBIGUOUS_RETRIES times.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from compiler import inputs as inputs_mod
from compiler.bounds import bound_program
from compiler.errors import CheckFailed, first_line
from compiler.weightsfile import sidecar

MAX_CASES = 48
MAX_PROBES = 2 * MAX_CASES + 1  # a probe per case at worst, twice for a case whose eager ends the context
PROBE_TIMEOUT_S = 240.0
# No new probe starts after this long: where every refused case costs a probe and each probe loads big weights, the
# cases left (the least dangerous values: they run in order) are recorded as not run, so the check stays well inside
# the worker's AOTC_CHECK_TIMEOUT_S (600 s by default).
BUDGET_S = 180.0
# Probes are forked from a zygote that has imported torch (Zygote); False: each probe imports torch itself.
ZYGOTE = True
ZYGOTE_START_S = 120.0  # the zygote's import of torch, and each fork, must answer within this
# On CUDA every case eager refuses costs a probe (the package's device-side assert ends its context), each a fresh
# context and package load: those cases are split between this many lanes of probes run side by side (each its own
# zygote), fewer where the package and its weights are large (LANE_BYTES of them at once, in host memory as they
# load and on the device). On a CPU a refused case rarely ends a probe, and probes share the cores: one lane.
CUDA_LANES = 3
CPU_LANES = 1
LANE_BYTES = 4 << 30
RESTART = 3  # a probe's exit status: the CUDA context is gone, go on in a new probe
UNKNOWN = "?"  # a case whose eager outcome the probe finds out on the device
# A case where eager and the package returned and disagree only on where values overflow, at inputs that drive the
# computation to the edge of its dtype's range (compiler.fp64.beyond_range): counted, with why, not failed.
BEYOND_RANGE = "beyond range"
# How a package that touched memory it does not own ends, as opposed to refusing: a fault signal on a CPU (an assert
# is SIGABRT, from std::terminate), an error of these words on CUDA (an assert is "device-side assert triggered").
FAULT_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS})
CUDA_FAULT = re.compile(r"illegal memory access|misaligned address|unspecified launch failure|illegal address")
# Of those words, "unspecified launch failure" (cudaErrorLaunchFailure) does not say that memory was touched: the
# driver also answers it to a context it reset because it could not switch it out in time (Xid 109, CTX SWITCH
# TIMEOUT), which a package trapping on its own device-side assert meets where other processes share the GPU. On
# an H200 shared by 8 workers' checks, GPT-2's, Llama's, ELECTRA's and OPT's packages ended so at an int64-max token
# id, each beside an Xid 109 in the kernel's log, while the same GPT-2 package refused that id cleanly in 4 of 4
# checks run alone. A case that ends with these words runs again, each time in a fresh probe after the lanes (none
# of this check's other probes beside it), up to AMBIGUOUS_RETRIES times: the first run that ends otherwise (a
# clean refusal, a return, another fault) is its verdict, and the fault stands where every run ended the same way.
# At most AMBIGUOUS_CASES cases are run again, and no probe for them starts after AMBIGUOUS_BUDGET_S (all rounds
# together): the rest keep their fault, which fails the check as before.
AMBIGUOUS_FAULT = re.compile(r"unspecified launch failure")
AMBIGUOUS_RETRIES = 2
AMBIGUOUS_CASES = 4
AMBIGUOUS_BUDGET_S = 90.0


def eager_verdicts(ep: torch.export.ExportedProgram, module: Any, flats: list[list[torch.Tensor]]) -> list[str | None]:
    """For each input list, None if eager `module` (on the CPU) returns, else what it raised."""
    out: list[str | None] = []
    for flat in flats:
        args, kwargs = inputs_mod.call_args(ep, flat)
        try:
            with torch.inference_mode():
                module(*args, **kwargs)
            out.append(None)
        except Exception as e:  # noqa: BLE001 - any exception is eager refusing the input
            out.append(first_line(e))
    return out


class _Partial(torch.fx.Interpreter):
    """Runs the program's graph, counting the nodes it ran (`ran`); with `keep`, records those nodes' values."""

    def __init__(self, module: torch.fx.GraphModule, keep: set[torch.fx.Node] | None = None) -> None:
        super().__init__(module)
        self.extra_traceback = False  # an op's own exception, as the module's forward raises it
        self.keep = keep or set()
        self.kept: dict[torch.fx.Node, Any] = {}
        self.ran = 0

    def run_node(self, n: torch.fx.Node) -> Any:
        value = super().run_node(n)
        self.ran += 1
        if n in self.keep:
            self.kept[n] = value
        return value


SKIPPED = object()  # a node a poisoned run does not run: nothing downstream of the poisoned input reads it

# Ops that can raise on the values of floating-point tensors (a factorisation that fails, a probability out of
# [0, 1], an assert): never skipped as "float arithmetic".
_RAISES_ON_FLOATS = frozenset({"assert", "linalg", "cholesky", "bernoulli", "multinomial", "check", "errors", "lu",
                               "inverse", "solve", "triangular"})


def _may_raise_on_floats(target: Any) -> bool:
    """Whether an op's name has a word of _RAISES_ON_FLOATS (aten::_linalg_check_errors, aten::bernoulli.p; not
    aten::relu, whose name only ends in "lu")."""
    schema = getattr(target, "_schema", None)
    name = schema.name if schema is not None else str(getattr(target, "__name__", target))
    return any(w in _RAISES_ON_FLOATS for w in re.split(r"[^a-z0-9]+", name.lower()))


# Ops that cannot raise whatever the values of their integer or boolean inputs (masks, positions, casts, shapes):
# a padding mask's poisoned values then run the ops that can raise on them, not every attention layer it reaches.
# Integer division, remainder and powers are not here (a zero divisor, a negative exponent raise).
_MASK_SAFE = frozenset(
    getattr(torch.ops.aten, name) for name in (
        "scaled_dot_product_attention where masked_fill mul add sub rsub neg abs sign eq ne lt le gt ge "
        "logical_and logical_or logical_not logical_xor bitwise_and bitwise_or bitwise_not bitwise_xor "
        "__and__ __or__ __xor__ to _to_copy type_as clone contiguous alias detach view reshape _unsafe_view expand "
        "expand_as unsqueeze squeeze permute transpose t flatten unflatten cumsum sum mean any all amax amin max min "
        "clamp clamp_min clamp_max minimum maximum cat stack full_like zeros_like ones_like empty_like softmax "
        "_softmax log_softmax _log_softmax").split()
    if hasattr(torch.ops.aten, name))


def _floats(value: Any) -> bool:
    """Whether a node's recorded value is floating-point tensors only (a tensor, or a tuple or list of them)."""
    if isinstance(value, (tuple, list)):
        return bool(value) and all(_floats(v) for v in value)
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


def _may_raise_cone(reached: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """Of the nodes a poisoned input reaches, those a poisoned run must run to see eager raise: every node that is
    neither float arithmetic nor one of _MASK_SAFE's ops (so: one that reads or makes an integer, boolean or
    symbolic value other than as a mask, cast, comparison or shape, an op that can raise on floats, or anything
    that is not a plain op call), and what such a node reads from the reached set. A text model's poisoned token
    ids then run its embeddings and the integer work on the ids (positions from a padding mask), not the network
    after them.

    Skipping float arithmetic decides nothing by itself: a case the poisoned run says eager returns on is run by
    eager again in the probe, which records an exception there as eager refusing (see `_probe`). The CPU verdict
    only orders the cases and spares the device an eager run that would end its context."""
    def cannot_raise(n: torch.fx.Node) -> bool:
        if n.op != "call_function":
            return False
        packet = getattr(n.target, "overloadpacket", None)
        if n.target is torch.ops.aten._assert_tensor_metadata.default or packet in _MASK_SAFE:
            return True
        return (not _may_raise_on_floats(n.target) and _floats(n.meta.get("val"))
                and all(_floats(i.meta.get("val")) for i in n.all_input_nodes if i in reached))
    todo = [n for n in reached if n.op == "placeholder" or (n.op != "output" and not cannot_raise(n))]
    cone: set[torch.fx.Node] = set()
    while todo:
        n = todo.pop()
        if n not in cone:
            cone.add(n)
            todo.extend(i for i in n.all_input_nodes if i in reached)
    return cone


def partial_verdicts(ep: torch.export.ExportedProgram, module: Any, base: list[torch.Tensor],
                     flats: list[list[torch.Tensor]],
                     poisoned_inputs: list[int], may_raise_only: bool = True) -> tuple[list[str | None], int] | None:
    """`eager_verdicts` for cases that each poison one input (`poisoned_inputs[k]`, an index into the flat inputs)
    of an in-range `base` that eager returns on. Only the nodes downstream of the poisoned input run again: every
    other node's value is the base run's, and only those that a downstream node reads are kept (a classifier's
    labels run the loss again, not the network). An exception can only come from a node that runs again, as the
    base run returned. With `may_raise_only`, of those only the nodes that can raise and what they read
    (`_may_raise_cone`: token ids run the embeddings, not the layers after them). Returns the verdicts and how many
    nodes ran in all (the base run's included); where the module is not one graph whose placeholders are the flat
    inputs, every case runs whole (nodes: -1). None where eager raises at `base` itself."""
    graph = getattr(module, "graph", None)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"] if isinstance(module, torch.fx.GraphModule) \
        and graph is not None else []
    if graph is None or len(placeholders) != len(base) or any(len(f) != len(base) for f in flats):
        if eager_verdicts(ep, module, [base])[0] is not None:
            return None
        return eager_verdicts(ep, module, flats), -1
    downstream: dict[int, set[torch.fx.Node]] = {}
    for k in set(poisoned_inputs):
        seen: set[torch.fx.Node] = set()
        todo = [placeholders[k]]
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo.extend(n.users)
        downstream[k] = _may_raise_cone(seen) if may_raise_only else seen
    frontier = {k: {i for n in nodes for i in n.all_input_nodes if i not in nodes and i.op != "placeholder"}
                for k, nodes in downstream.items()}
    keep = set().union(*frontier.values())
    # The interpreter takes the graph's flat inputs (its placeholders), as the module's forward flattens a call's
    # arguments: Interpreter.run takes no keywords, so a program exported with keyword inputs would raise here.
    recorder = _Partial(module, keep)
    try:
        with torch.inference_mode():
            recorder.run(*base)
    except Exception:  # noqa: BLE001 - eager refuses the in-range inputs: no case can be decided from them
        return None
    ran = recorder.ran
    out: list[str | None] = []
    for flat, k in zip(flats, poisoned_inputs, strict=True):
        env: dict[torch.fx.Node, Any] = {n: SKIPPED for n in graph.nodes
                                         if n.op != "placeholder" and n not in downstream[k]}
        env.update({n: recorder.kept[n] for n in frontier[k]})
        runner = _Partial(module)
        try:
            with torch.inference_mode():
                runner.run(*flat, initial_env=env)
            out.append(None)
        except Exception as e:  # noqa: BLE001 - any exception is eager refusing the input
            out.append(first_line(e))
        ran += runner.ran
    return out, ran


def cpu_copy(model_path: str) -> tuple[torch.export.ExportedProgram, Any]:
    """The uploaded program, loaded again and moved to the CPU: weights, constants and device arguments alike."""
    from torch.export.passes import move_to_device_pass

    from compiler.loading import load_program

    ep = move_to_device_pass(load_program(model_path), "cpu")
    return ep, ep.module()


class Zygote:
    """A process that has imported torch and the probe's modules, and nothing more (no CUDA context, no thread pool
    started), which forks each probe: a probe then starts in milliseconds instead of importing torch again (4.6 s
    on a GPU host, more under load), and the check on CUDA starts one per refused case. `python -m
    compiler.adversarial --zygote` reads one JSON request a line on stdin ({"argv", "log"}), answers {"pid"} once
    the probe is forked and {"pid", "rc"} when it ends (rc as subprocess's returncode: minus the signal). Closing
    its stdin ends it. Where it cannot start or dies, `run_probes` starts each probe as a process of its own."""

    def __init__(self, log_path: Path) -> None:
        """Starts it; its import of torch goes on while the caller does other work, until `ready` is first asked."""
        self.log = open(log_path, "wb")  # noqa: SIM115 - closed in close()
        self.pending = b""
        self.closed = False
        self.proc = subprocess.Popen([sys.executable, "-P", "-m", "compiler.adversarial", "--zygote"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     start_new_session=True)
        self._ready: bool | None = None

    @property
    def ready(self) -> bool:
        """Whether it said it is ready (within ZYGOTE_START_S of the first time this is asked) and is not closed."""
        if self._ready is None:
            self._ready = self._line(ZYGOTE_START_S) == {"ready": True}
        return self._ready and not self.closed

    def _line(self, timeout: float) -> dict[str, Any] | None:
        """The zygote's next answer, or None if none comes in `timeout` (or it has ended). Read from the pipe's
        descriptor, unbuffered: two answers that arrive together (a probe that ends at once) must not leave the
        second in a file object's buffer, where select cannot see it."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return json.loads(line) if line.strip() else None

    def run(self, argv: list[str], log_path: Path, timeout: float) -> tuple[bool, int | None]:
        """(started, rc): rc None when the probe did not finish in `timeout` (it is killed, with its group)."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps({"argv": argv, "log": str(log_path)}) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            return False, None
        forked = self._line(ZYGOTE_START_S)
        if not forked or "pid" not in forked:
            return False, None
        ended = self._line(timeout)
        if ended is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(forked["pid"], signal.SIGKILL)
            self._line(ZYGOTE_START_S)  # the zygote's word that it has reaped the killed probe
            return True, None
        return True, int(ended["rc"])

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(OSError):
            if self.proc.stdin:
                self.proc.stdin.close()
        _wait_or_kill(self.proc, 5.0)
        self.log.close()


class Prestarted:
    """Zygotes started when a check begins, one for each lane it may run (CUDA_LANES on CUDA): their import of torch
    (4.6 s on a GPU host) then runs beside the check's eager and plain runs, not before its first probe. Started
    only where the spec has an integer or bool input, so a check with no adversarial cases (an image model's) does
    not pay for them; a float input cast to an index still gets its zygotes when its probes need them. `take` hands
    them to `check_adversarial`, which closes them; `close` ends those never taken."""

    def __init__(self, device: str, spec: inputs_mod.Spec) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="aotc-zygotes-")
        wanted = bool(inputs_mod.integer_inputs(spec)) or any(i["dtype"] == "bool" for i in spec)
        n = (CUDA_LANES if device.startswith("cuda") else CPU_LANES) if ZYGOTE and wanted else 0
        self._all = [Zygote(Path(self._dir.name) / f"zygote-{i}.log") for i in range(n)]
        self.zygotes = list(self._all)

    def take(self) -> list[Zygote]:
        taken, self.zygotes = self.zygotes, []
        return taken

    def close(self) -> None:
        """Ends every zygote it started (those taken too, where the check ended before closing them)."""
        for z in self._all:
            z.close()
        self._dir.cleanup()


def _wait_or_kill(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """`proc`'s status, or None when it did not end in `timeout` (then it is killed, with its session's group)."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None


def _exec_probe(cmd: list[str], log_path: Path) -> int | None:
    """A probe as a process of its own (the zygote could not start it); None when it did not finish in time."""
    with open(log_path, "ab") as log:
        return _wait_or_kill(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True),
                             PROBE_TIMEOUT_S)


def run_probes(model_path: str, package_path: str, device: str, cases: list[dict[str, Any]], tolerance: float,
               workdir: Path, autocast: str = "none", budget: float | None = None, zygote: Zygote | None = None,
               ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run `cases` (each {"inputs": flat CPU tensors, "eager": None | what eager raised | UNKNOWN}) in probe
    children, in order; returns one result per case and what the probes cost. `autocast` ("bfloat16", "float16"
    or "none"): the dtype eager's forward runs under in the probes, a train step's precision (the check's own).
    No probe starts after `budget` seconds (BUDGET_S by default). `zygote`: the caller's (left open, unless it
    failed here), else one started here and closed at the end."""
    budget = BUDGET_S if budget is None else budget
    own = zygote is None
    cases_path = workdir / "cases.pt"
    torch.save([{"inputs": c["inputs"], "eager": c["eager"]} for c in cases], cases_path)
    results: dict[int, dict[str, Any]] = {}
    probes, start = 0, 0
    t0 = time.perf_counter()
    if own:
        zygote = Zygote(workdir / "zygote.log") if ZYGOTE else None
    forked = 0
    walls: list[float] = []  # each probe's wall time, from its start to its exit
    setups: list[dict[str, float]] = []  # each probe's "ready" line: its context, package and program loads
    spent_on = {False: 0.0, True: 0.0}  # seconds in cases eager returned on (False) and refused (True)
    try:
        while start < len(cases):
            spent = time.perf_counter() - t0
            if probes >= MAX_PROBES or spent > budget:
                why = (f"the check starts at most {MAX_PROBES} probes" if probes >= MAX_PROBES
                       else f"the adversarial budget of {budget:.0f} s was spent ({spent:.0f} s)")
                for k in range(start, len(cases)):
                    results[k] = {"k": k, "outcome": "not run", "why": why}
                break
            probes += 1
            out_path = workdir / f"probe-{probes}.jsonl"
            log_path = workdir / f"probe-{probes}.log"
            argv = [model_path, package_path, device, str(cases_path), str(out_path), str(start), repr(tolerance),
                    autocast]
            began = time.perf_counter()
            started, rc = zygote.run(argv, log_path, PROBE_TIMEOUT_S) if zygote and zygote.ready else (False, None)
            if started:
                forked += 1
            else:
                if zygote is not None:  # it could not start, or died: every probe from here is a process of its own
                    zygote.close()
                    zygote = None
                # -P, as the worker starts its children: the working directory (where a sandboxed child keeps
                # Triton's cache dir, named `triton`) must not shadow a package.
                rc = _exec_probe([sys.executable, "-P", "-m", "compiler.adversarial", *argv], log_path)
            walls.append(time.perf_counter() - began)
            text = out_path.read_text() if out_path.exists() else ""
            lines = [json.loads(ln) for ln in text.splitlines() if ln.strip()]
            in_flight: dict[str, Any] | None = None
            for line in lines:
                if line.get("event") == "ready":
                    setups.append(line)
                elif "outcome" in line:
                    spent_on[bool(line.get("eager"))] += line.get("s") or 0.0
                    results[line["k"]] = line
                    in_flight = None
                else:
                    in_flight = line
            done = max([k for k in results if k >= start], default=start - 1)
            if in_flight is None:
                if rc not in (0, RESTART) and done + 1 < len(cases):
                    # It died between cases (loading the program or the package): nothing more will come of it.
                    tail = log_path.read_bytes()[-2000:].decode("utf-8", "replace")
                    raise RuntimeError(f"the adversarial probe exited with status {rc} before case {done + 1}: {tail}")
                start = done + 1
                continue
            k = in_flight["k"]
            how = f"did not finish in {PROBE_TIMEOUT_S:.0f} s" if rc is None else _death(rc)
            if in_flight["event"] == "package":
                refused = in_flight.get("eager")
                faulted = rc is not None and -rc in FAULT_SIGNALS
                results[k] = {"k": k, "eager": refused, "package": f"the process {how}",
                              "outcome": "package faulted" if faulted else "refused" if refused else "package died"}
                start = k + 1
            elif rc is None:
                results[k] = {"k": k, "eager": f"the process {how}", "outcome": "eager did not finish"}
                start = k + 1
            else:
                # Eager refused by ending the process or its CUDA context: the package must not return either, which
                # a new probe finds out.
                cases[k]["eager"] = in_flight.get("eager") or f"the process {how}"
                torch.save([{"inputs": c["inputs"], "eager": c["eager"]} for c in cases], cases_path)
                start = k
    finally:
        if zygote is not None and own:
            zygote.close()
    cost = {"probes": probes, "forked": forked, "seconds": round(time.perf_counter() - t0, 3), "walls": walls,
            "setups": setups, "returned_s": spent_on[False], "refused_s": spent_on[True]}
    return [results[k] for k in range(len(cases))], cost


def _summed(costs: list[dict[str, Any]]) -> dict[str, Any]:
    """`run_probes` costs added up: the probes, the forked ones, each probe's wall time and set-up, the cases'
    seconds."""
    return {"probes": sum(c["probes"] for c in costs), "forked": sum(c["forked"] for c in costs),
            "walls": [w for c in costs for w in c["walls"]], "setups": [x for c in costs for x in c["setups"]],
            "returned_s": sum(c["returned_s"] for c in costs), "refused_s": sum(c["refused_s"] for c in costs)}


def probe_costs(cost: dict[str, Any]) -> dict[str, Any]:
    """What the probes cost, for the check's record: the median probe's wall time and its parts before the first
    case (the CUDA context, the package's load with its weights, the program's load where eager runs in the
    probe); the seconds the cases took, those eager returned on and those it refused, all probes together; and
    each lane's seconds, where lanes ran side by side."""
    walls, setups = cost["walls"], cost["setups"]
    if not walls:
        return {}
    out: dict[str, Any] = {"median_s": round(statistics.median(walls), 3), "max_s": round(max(walls), 3)}
    for part in ("context_s", "package_s", "program_s"):
        got = [s[part] for s in setups if part in s]
        if got:
            out[part] = round(statistics.median(got), 3)
    out["cases_s"] = {"eager returned": round(cost["returned_s"], 3), "eager refused": round(cost["refused_s"], 3)}
    if "lanes_s" in cost:
        out["lanes_s"] = cost["lanes_s"]
    return out


def probe_lanes(device: str, package_path: str, refused: int) -> int:
    """How many lanes of probes run the `refused` cases (those eager refuses) side by side: see CUDA_LANES."""
    size = sum(p.stat().st_size for p in (Path(package_path), sidecar(package_path)) if p.exists())
    by_memory = max(1, LANE_BYTES // max(size, 1))
    return max(1, min(CUDA_LANES if device.startswith("cuda") else CPU_LANES, refused, by_memory))


def run_probe_lanes(model_path: str, package_path: str, device: str, cases: list[dict[str, Any]], tolerance: float,
                    workdir: Path, autocast: str = "none", zygotes: list[Zygote] | None = None,
                    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`run_probes` over `cases`, on `probe_lanes` lanes that run side by side, each with a zygote of its own (one
    of `zygotes`, started ahead by the caller, where there is one left: see `Prestarted`). The first lane runs the
    cases eager returns on (or that the probe decides) first, in one probe, in their order; the cases eager refuses
    are then taken one at a time, in order, by whichever lane is free, each in a probe of its own (on CUDA each
    ends its probe's context). No lane takes a case after BUDGET_S: those left are recorded as not run. One result
    per case, in `cases`' order; the cost adds the lanes' probes, says how many lanes ran and what each took.

    Taken as lanes come free, rather than dealt round-robin ahead: the first lane's own cases (the program loaded
    on the device, every case eager returns on) took as long as six refused cases on DistilBERT on an H200, so,
    dealt its share of those too, it ran 16.4 s while the other two lanes ran 10.6 s."""
    refused = [k for k, c in enumerate(cases) if c["eager"] not in (None, UNKNOWN)]
    lanes = probe_lanes(device, package_path, len(refused))
    spare = list(zygotes or [])
    if lanes <= 1:
        alone, cost = run_probes(model_path, package_path, device, cases, tolerance, workdir, autocast,
                                 zygote=spare.pop(0) if spare else None)
        for z in spare:
            z.close()
        return _run_ambiguous_again(model_path, package_path, device, cases, tolerance, workdir, autocast, alone,
                                    {**cost, "lanes": 1})
    taken = set(refused)
    returned = [k for k in range(len(cases)) if k not in taken]
    results: list[dict[str, Any]] = [{} for _ in cases]
    queue = list(reversed(refused))
    lock = threading.Lock()
    t0 = time.perf_counter()

    def claim() -> int | None:
        with lock:
            return queue.pop() if queue else None

    def lane(i: int) -> dict[str, Any]:
        home = workdir / f"lane-{i}"
        home.mkdir()
        with lock:
            zygote = spare.pop(0) if spare else (Zygote(home / "zygote.log") if ZYGOTE else None)
        spent: list[dict[str, Any]] = []

        def run(group: list[int], where: Path) -> None:
            where.mkdir()
            found, cost = run_probes(model_path, package_path, device, [cases[k] for k in group], tolerance, where,
                                     autocast, budget=BUDGET_S - (time.perf_counter() - t0), zygote=zygote)
            for k, r in zip(group, found, strict=True):
                results[k] = {**r, "k": k}
            spent.append(cost)

        began = time.perf_counter()
        try:
            if i == 0 and returned:
                run(returned, home / "returned")
            while (k := claim()) is not None:
                elapsed = time.perf_counter() - t0
                if elapsed > BUDGET_S:
                    results[k] = {"k": k, "outcome": "not run",
                                  "why": f"the adversarial budget of {BUDGET_S:.0f} s was spent ({elapsed:.0f} s)"}
                    continue
                run([k], home / f"case-{k}")
        finally:
            if zygote is not None:
                zygote.close()
        return {**_summed(spent), "seconds": round(time.perf_counter() - began, 3)}

    try:
        with ThreadPoolExecutor(lanes, thread_name_prefix="aotc-probe-lane") as pool:
            got = list(pool.map(lane, range(lanes)))
    finally:
        for z in spare:
            z.close()
    cost = {**_summed(got), "seconds": round(time.perf_counter() - t0, 3), "lanes": lanes,
            "lanes_s": [c["seconds"] for c in got]}
    return _run_ambiguous_again(model_path, package_path, device, cases, tolerance, workdir, autocast, results, cost)


def ambiguous(result: dict[str, Any]) -> bool:
    """Whether a case's result is a fault whose words do not say that memory was touched (see AMBIGUOUS_FAULT)."""
    package = str(result.get("package") or "")
    return (result.get("outcome") == "package faulted" and AMBIGUOUS_FAULT.search(package) is not None
            and CUDA_FAULT.search(AMBIGUOUS_FAULT.sub("", package)) is None)


def _run_ambiguous_again(model_path: str, package_path: str, device: str, cases: list[dict[str, Any]],
                         tolerance: float, workdir: Path, autocast: str, results: list[dict[str, Any]],
                         cost: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The cases of `results` that ended in an ambiguous fault, run again (see AMBIGUOUS_FAULT). A case's new
    result keeps what the earlier runs' package said ("earlier"); the cost counts the new probes and the cases run
    again ("again")."""
    t0, again_total = time.perf_counter(), 0
    for round_ in range(1, AMBIGUOUS_RETRIES + 1):
        again = [k for k, r in enumerate(results) if ambiguous(r)][:AMBIGUOUS_CASES]
        left = AMBIGUOUS_BUDGET_S - (time.perf_counter() - t0)
        if not again or left <= 0:
            break
        again_total = max(again_total, len(again))
        (workdir / f"again-{round_}").mkdir()
        found, spent = run_probes(model_path, package_path, device, [cases[k] for k in again], tolerance,
                                  workdir / f"again-{round_}", autocast, budget=left)
        cost.update(_summed([cost, spent]))
        for k, r in zip(again, found, strict=True):
            if r.get("outcome") == "not run":  # the round's budget was spent before it: the fault stands
                continue
            earlier = [*results[k].get("earlier", []), results[k].get("package")]
            results[k] = {**r, "k": k, "earlier": earlier}
    if again_total:
        cost["again"] = again_total
        cost["seconds"] = round(cost["seconds"] + time.perf_counter() - t0, 3)
    return results, cost


def _death(rc: int) -> str:
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with status {rc}"


def verdict(poison: inputs_mod.Poison, numel: int, result: dict[str, Any]) -> str | None:
    """None when the case ended as it must; else the message that fails the check."""
    what = poison.describe(numel)
    outcome = result.get("outcome")
    # Cases not run are counted in the summary, not failed; so are those beyond their dtype's range, with why.
    if outcome in ("refused", "agreed", "not run", BEYOND_RANGE):
        return None
    if outcome == "returned":
        return f"{what}: eager raises {result.get('eager')}, the package returned"
    if outcome == "differs":
        return f"{what}: the package's result differs from eager: {result.get('why')}"
    if outcome == "package raised":
        return f"{what}: the package raises ({result.get('package')}) where eager returns"
    if outcome == "package died":
        return f"{what}: {result.get('package')} where eager returns"
    if outcome == "package faulted":
        eager = f"eager raises {result['eager']}" if result.get("eager") else "eager returns"
        runs = len(result.get("earlier", [])) + 1
        again = (f"; it ended so in {runs} runs, {runs - 1} of them after the check's other probes had ended"
                 if runs > 1 else "")
        return f"{what}: {eager}, the package touched memory it does not own ({result.get('package')}{again})"
    return f"{what}: {outcome}: {result.get('why') or result.get('eager') or ''}".rstrip(": ")


def refuse_failures(found: dict[str, Any], what: str, where: str = "") -> None:
    """Raise CheckFailed for `check_adversarial`'s answer if it found failures: the first in the message (`what`
    names the package, `where` the shapes), every one in the excerpt."""
    if found["failures"]:
        more = len(found["failures"]) - 1
        raise CheckFailed(f"{what} fails the adversarial check{where}: {found['failures'][0]}"
                          + (f"; and {more} more case(s), in the excerpt" if more else ""),
                          stage="check", excerpt="\n".join(found["failures"]))


def cases_at(ep: torch.export.ExportedProgram, spec: inputs_mod.Spec, shapes: list[list[int]],
             ranges: list[tuple[int, int] | None]) -> tuple[list[inputs_mod.Poison], list[int]]:
    """The adversarial cases at one shape point, as the check tries them, and the program's dim sizes there (the
    values they draw on)."""
    sizes = inputs_mod.dim_sizes(ep, shapes)
    floats, masks = inputs_mod.index_inputs(ep, spec)
    return inputs_mod.adversarial_cases(spec, shapes, ranges, sizes, MAX_CASES, floats, masks), sizes


@dataclass
class Oracle:
    """What eager says of each adversarial case at one shape point, decided before any package is loaded (see
    `oracle_at`): the cases (`poisons`, their inputs `flats`), eager's verdict on each, and how it was reached."""

    poisons: list[inputs_mod.Poison]
    sizes: list[int]
    flats: list[list[torch.Tensor]] = field(default_factory=list)
    eager: list[str | None] = field(default_factory=list)
    oracle: str = ""
    cpu_nodes_run: Any = None
    bounds: dict[str, int] = field(default_factory=dict)  # the CPU copy's ops rewritten to checked forms, and checked
    # before they index (compiler.bounds)
    seconds: float = 0.0


def oracle_at(model_path: str, spec: inputs_mod.Spec, device: str, ep: torch.export.ExportedProgram,
              base: list[torch.Tensor], shapes: list[list[int]], ranges: list[tuple[int, int] | None]) -> Oracle:
    """The adversarial cases at one shape point (`base`: the in-range random inputs there, on the CPU) and eager's
    verdict on each. It needs the program only, never the package: a check started before its package exists (the
    worker's early check) decides them while the compile runs."""
    t0 = time.perf_counter()
    poisons, sizes = cases_at(ep, spec, shapes, ranges)
    found = Oracle(poisons, sizes)
    if not poisons:
        return found
    found.flats = [inputs_mod.poisoned(base, p) for p in poisons]
    found.oracle = f"eager on the CPU ({torch.__version__})"
    on_cuda = device.startswith("cuda")
    # Eager's verdicts come from a CPU copy of the program: on CUDA an out-of-range index in eager is a device-side
    # assert too, which would end the check's own context. The copy is bounded where eager ATen is not
    # (compiler.bounds' rewrites, and `eager_gaps`), since some kernels read wherever an adversarial value points
    # instead of raising: embedding_bag's middle offsets read past the ids, which took down the check's own process
    # with SIGSEGV on an H200 (2026-11-30) and on the CPU box returned what it found there. Bounded, such a case
    # raises, as the package must; every other op raises eager's own error.
    oracle_ep = cpu_copy(model_path)[0]
    bounded = bound_program(oracle_ep, eager_gaps=True)
    found.bounds = {"rewritten": len(bounded.rewritten), "range_checked": len(bounded.range_checked)}
    module = oracle_ep.module()
    decided = partial_verdicts(oracle_ep, module, base, found.flats, [p.input for p in poisons])
    if decided is None and on_cuda:
        found.eager = [UNKNOWN] * len(found.flats)
        found.oracle = "eager on the device, in the probes (the program's CPU copy raises at in-range inputs)"
    elif decided is None:  # eager raises at the in-range start too: each case, whole
        found.eager = eager_verdicts(oracle_ep, module, found.flats)
    else:
        found.eager, found.cpu_nodes_run = list(decided[0]), decided[1]
        if on_cuda:
            found.oracle = "eager on a CPU copy of the program"
    found.seconds = round(time.perf_counter() - t0, 3)
    return found


def check_adversarial(model_path: str, package_path: str, spec: inputs_mod.Spec, device: str,
                      ep: torch.export.ExportedProgram, base: list[torch.Tensor], shapes: list[list[int]],
                      ranges: list[tuple[int, int] | None], tolerance: float,
                      autocast: torch.dtype | None = None, zygotes: list[Zygote] | None = None,
                      decided: Oracle | None = None) -> dict[str, Any]:
    """The adversarial cases at one shape point (`base`: the in-range random inputs there, on the CPU). Returns the
    summary for the check's record, with "failures" (messages) empty when every case ended as it must.
    `autocast`: a train step's precision; eager's forward in the probes runs under it, as in the training check
    (fp32 eager against a bf16 step refused resnet50 on an H200: its logits 0.13 apart at an in-range label).
    `zygotes`: started ahead (Prestarted), for the probe lanes; closed here. `decided`: eager's verdicts, where
    `oracle_at` ran ahead (the summary's `oracle_s` says how long it took there)."""
    t0 = time.perf_counter()
    ahead = decided is not None
    found = decided if decided is not None else oracle_at(model_path, spec, device, ep, base, shapes, ranges)
    poisons, sizes, flats, eager = found.poisons, found.sizes, found.flats, found.eager
    summary: dict[str, Any] = {"cases": len(poisons), "max_cases": MAX_CASES, "failures": []}
    if not poisons:
        for z in zygotes or []:
            z.close()
        summary["note"] = ("no integer inputs, no float input cast to an integer, no bool mask it indexes by: "
                           "nothing to try")
        return summary
    oracle = found.oracle
    if found.cpu_nodes_run is not None:
        summary["cpu_nodes_run"] = found.cpu_nodes_run
    summary["oracle_bounds"] = found.bounds
    if ahead:
        summary["oracle_s"] = found.seconds
    # Cases eager returns first, those it refuses last: on CUDA a refused case ends the probe's context.
    order = sorted(range(len(poisons)), key=lambda k: eager[k] not in (None, UNKNOWN))
    cases = [{"inputs": flats[k], "eager": eager[k]} for k in order]
    with tempfile.TemporaryDirectory(prefix="aotc-adversarial-") as tmp:
        results, cost = run_probe_lanes(model_path, package_path, device, cases, tolerance, Path(tmp),
                                        str(autocast).removeprefix("torch.") if autocast is not None else "none",
                                        zygotes)
    numels = [t.numel() for t in base]
    rows: list[dict[str, Any]] = [{} for _ in poisons]
    for k, r in zip(order, results, strict=True):
        p = poisons[k]
        rows[k] = {**asdict(p), "eager": r.get("eager"), "package": r.get("package"), "outcome": r.get("outcome"),
                   **({"earlier": r["earlier"]} if r.get("earlier") else {}),
                   **({"why": r.get("why")} if r.get("outcome") == BEYOND_RANGE else {})}
        message = verdict(p, numels[p.input], r)
        if message:
            summary["failures"].append(message)
    counts: dict[str, int] = {}
    for r in rows:
        counts[str(r["outcome"])] = counts.get(str(r["outcome"]), 0) + 1
    summary.update(
        oracle=oracle, outcomes=counts, probes=cost["probes"], forked=cost["forked"], probe_seconds=cost["seconds"],
        probe_lanes=cost["lanes"], run_again=cost.get("again", 0),
        probe_cost=probe_costs(cost),
        seconds=round(time.perf_counter() - t0, 3),
        inputs={spec[k]["name"]: sorted({p.value for p in poisons if p.input == k})
                for k in sorted({*inputs_mod.integer_inputs(spec), *(p.input for p in poisons)})},
        dim_sizes=sizes[:inputs_mod.MAX_DIM_SIZES], results=rows)
    return summary


# -- the probe child ---------------------------------------------------------------------------------------------


def _context_lost(device: str) -> bool:
    if not device.startswith("cuda"):
        return False
    try:
        torch.cuda.synchronize()
        (torch.ones(1, device=device) + 1).item()
        return False
    except Exception:  # noqa: BLE001 - any failure means the context cannot be trusted
        return True


def _probe(model_path: str, package_path: str, device: str, cases_path: str, out_path: str, start: int,
           tolerance: float, autocast: str = "none") -> int:
    from compiler.check import compare
    from compiler.compat import pytree
    from compiler.compat.aoti import aoti_load_package, train_step_loss_output
    from compiler.loading import load_program, on_device

    cases = torch.load(cases_path, weights_only=True)
    cuda = device.startswith("cuda")
    t0 = time.perf_counter()
    if cuda:
        torch.empty(1, device=device)  # the context, timed apart from the package's load
    t1 = time.perf_counter()
    package: Any = aoti_load_package(package_path, device)
    t2 = time.perf_counter()
    in_spec = getattr(package, "in_spec", None)
    loss_output = train_step_loss_output(package)
    if loss_output is not None:  # a train step: its flat outputs lead with the loss and the program's other outputs
        step = package

        def call(*args: Any, **kwargs: Any) -> Any:
            return step.run_flat(step.flat_inputs(args, kwargs))

        package = call
    ep: torch.export.ExportedProgram | None = None
    eager: Any = None
    if in_spec is None or any(c["eager"] in (None, UNKNOWN) for c in cases[start:]):
        # eager runs here, or the package cannot say how its inputs nest
        ep = on_device(load_program(model_path), device)
        eager = ep.module()
        eager.to(device)
        if autocast != "none":  # export's dtype asserts before each .to()/.float() would refuse autocast's dtypes
            from compiler.specialize import drop_metadata_asserts

            drop_metadata_asserts(eager)
    ready = {**({"context_s": round(t1 - t0, 4)} if cuda else {}), "package_s": round(t2 - t1, 4),
             "program_s": round(time.perf_counter() - t2, 4)}

    def amp() -> Any:  # a train step's precision, as its check ran eager (a new context per case)
        if autocast == "none":
            return contextlib.nullcontext()
        return torch.autocast("cuda" if cuda else "cpu", dtype=getattr(torch, autocast))

    began = 0.0  # the case's start: its outcome line says how long it took ("s")

    with open(out_path, "a", buffering=1) as out:
        def write(**line: Any) -> None:
            if "outcome" in line:
                line["s"] = round(time.perf_counter() - began, 4)
            out.write(json.dumps(line) + "\n")
            out.flush()
            os.fsync(out.fileno())

        write(event="ready", **ready)
        for k in range(start, len(cases)):
            began = time.perf_counter()
            write(k=k, event="start")
            case = cases[k]
            flat = [t.to(device) for t in case["inputs"]]
            if ep is not None:
                args, kwargs = inputs_mod.call_args(ep, flat)
            else:  # the package's own input structure, which is the program's
                assert in_spec is not None
                unflat_args, kwargs = pytree.tree_unflatten(flat, in_spec)
                args = tuple(unflat_args)
            refused = case["eager"] if case["eager"] not in (None, UNKNOWN) else None
            expected = None
            if refused is None:
                try:
                    with torch.inference_mode(), amp():
                        expected = eager(*args, **kwargs)
                        if cuda:
                            torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001
                    refused = first_line(e)
                    if _context_lost(device):
                        write(k=k, event="eager lost the context", eager=refused)
                        return RESTART  # the case runs again in a new probe, as one eager refuses
            write(k=k, event="package", eager=refused)
            try:
                with torch.inference_mode():
                    actual = package(*args, **kwargs)
                    if cuda:
                        torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001
                raised = first_line(e)
                outcome = "package faulted" if CUDA_FAULT.search(str(e)) else "refused" if refused else "package raised"
                write(k=k, eager=refused, package=raised, outcome=outcome)
                if _context_lost(device):
                    return RESTART
                continue
            if refused:
                write(k=k, eager=refused, package="returned", outcome="returned")
                continue
            if loss_output is not None:  # the package's [loss, others] against eager's outputs in that order
                flat_expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
                expected = [flat_expected[loss_output], *(t for i, t in enumerate(flat_expected) if i != loss_output)]
                actual = list(actual)[:len(expected)]
            cmp = compare(expected, actual, tolerance, allow_nonfinite=True)
            if not cmp["ok"]:
                cmp = _judged_by_float64(cmp, eager, args, kwargs, expected, actual, loss_output, tolerance)
            outcome = "differs" if not cmp["ok"] else BEYOND_RANGE if cmp.get("beyond_range") else "agreed"
            write(k=k, eager=None, package="returned", outcome=outcome, why=cmp.get("why") or cmp.get("beyond_range"),
                  **({"fp64": cmp["fp64"]} if "fp64" in cmp else {}))
    return 0


def _judged_by_float64(cmp: dict[str, Any], eager: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                       expected: Any, actual: Any, loss_output: int | None, tolerance: float) -> dict[str, Any]:
    """A probe's failed comparison judged again against eager in float64 (compiler.fp64), as the checks judge
    theirs: at a boundary a bf16 step's outputs may differ from eager's by rounding alone (resnet50's logits under
    bf16 autocast were 9 % apart on an H200 at an in-range label). A case that differs only in where its values
    overflow, at inputs that drive the computation to the edge of its dtype's range, is accepted as beyond it
    (fp64.beyond_range: an int64-max attention mask cast to the model's dtype). Where no float64 run can be made,
    it stands."""
    from compiler import fp64

    try:
        ref, peak = fp64.float64_peak_run(eager, args, kwargs)
    except Exception:  # noqa: BLE001 - an op without a float64 kernel: the first judgment stands
        return cmp
    if loss_output is not None:  # in the package's order: the loss, then the program's other outputs
        flat = list(ref) if isinstance(ref, (tuple, list)) else [ref]
        ref = [flat[loss_output], *(t for i, t in enumerate(flat) if i != loss_output)]
    judged = fp64.second_opinion(cmp, expected, actual, ref, tolerance)
    return judged if judged.get("ok") else fp64.beyond_range(judged, expected, actual, ref, peak)


def _zygote() -> int:
    """The zygote's loop (see Zygote). Imports what a probe imports, touches no device, then forks a probe per
    request. Each probe runs in a session of its own (the check kills its group on a timeout) with its output in
    its log, and leaves with `_probe`'s status (1 for an exception, with its traceback in the log)."""
    import traceback

    from compiler import check, loading  # noqa: F401 - imported once, here, for every probe
    from compiler.compat import aoti, pytree  # noqa: F401

    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the probe
            rc = 1
            try:
                os.setsid()
                fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.close(fd)
                sys.stdin.close()
                rc = main(request["argv"])
            except BaseException:  # noqa: BLE001 - the probe's own failure, in its log, as an exception exits 1
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(rc)
        out.write(json.dumps({"pid": pid}) + "\n")
        out.flush()
        _, status = os.waitpid(pid, 0)
        out.write(json.dumps({"pid": pid, "rc": os.waitstatus_to_exitcode(status)}) + "\n")
        out.flush()
    return 0


def main(argv: list[str]) -> int:
    if argv == ["--zygote"]:
        return _zygote()
    model_path, package_path, device, cases_path, out_path, start, tolerance, autocast = argv
    if autocast not in ("none", "bfloat16", "float16"):
        raise SystemExit(f"autocast must be none, bfloat16 or float16, not {autocast!r}")
    return _probe(model_path, package_path, device, cases_path, out_path, int(start), float(tolerance), autocast)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
