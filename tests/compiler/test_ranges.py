"""compiler.ranges: on a CPU target every op that indexes with a tensor checks the whole index first, so an
out-of-range index raises in the package's wrapper (a RuntimeError the caller catches) instead of in an OpenMP
region (std::terminate, the caller's process gone). Eager semantics on the rewritten program first, then real
packages called in a child process through the SDK's loader."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from compiler.bounds import bound_program
from modelzoo import exported

aten = torch.ops.aten


def outcome(module: Any, *args: Any) -> Any:
    try:
        return module(*args)
    except Exception:  # noqa: BLE001 - whether it raised is the outcome
        return Exception


def agree(a: Any, b: Any) -> bool:
    if a is Exception or b is Exception:
        return a is b
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


X = torch.randn(4, 3)
# (what, fn, index position, the index exported with, the indices to try)
ROW = [[0, 1, 2], [3, 0, 1], [-1, 0, 0], [-4, 0, 0], [-5, 0, 0], [4, 0, 0], [2**62, 0, 0], [-2**63, 0, 0]]
CASES: list[tuple[str, Any, Any, list[Any]]] = [
    ("index", lambda x, i: x[i], [0, 1, 2], ROW),
    ("index, second dim", lambda x, i: x[:, i], [0, 1, 2], ROW),
    ("index_put", lambda x, i: x.index_put((i,), torch.ones(3, 3)), [0, 1, 2], ROW),
    ("index_select", lambda x, i: x.index_select(0, i), [0, 1, 2], ROW),
    ("index_fill", lambda x, i: x.index_fill(0, i, 1.0), [0, 1, 2], ROW),
    ("index_add", lambda x, i: x.index_add(0, i, torch.ones(3, 3)), [0, 1, 2], ROW),
    ("index_copy", lambda x, i: x.index_copy(0, i, torch.ones(3, 3)), [0, 1, 2], ROW),
    ("gather", lambda x, i: x.gather(0, i[None]), [0, 1, 2], ROW),
    ("scatter", lambda x, i: x.scatter(0, i[None], 1.0), [0, 1, 2], ROW),
    ("scatter_add", lambda x, i: x.scatter_add(0, i[None], torch.ones(1, 3)), [0, 1, 2], ROW),
    ("scatter_reduce", lambda x, i: x.scatter_reduce(0, i[None], torch.ones(1, 3), "amax"), [0, 1, 2], ROW),
    ("take", lambda x, i: x.take(i), [0, 1, 2], ROW + [[11, -12, 0], [12, 0, 0], [-13, 0, 0]]),
    ("embedding", lambda x, i: F.embedding(i, x), [0, 1, 2], ROW),
    ("embedding, padding_idx", lambda x, i: F.embedding(i, x, padding_idx=0), [0, 1, 2], ROW),
    ("embedding_bag", lambda x, i: F.embedding_bag(i[None], x), [0, 1, 2], ROW),
    ("cross_entropy", lambda x, i: F.cross_entropy(x[:3], i), [0, 1, 2],
     [[0, 1, 2], [2, -100, 0], [-1, 0, 0], [3, 0, 0], [-101, 0, 0]]),
    ("nll_loss, ignore_index -1", lambda x, i: F.nll_loss(x[:3], i, ignore_index=-1), [0, 1, 2],
     [[0, 1, 2], [-1, 2, 0], [-100, 0, 0], [3, 0, 0]]),
]


@pytest.mark.parametrize("what,fn,sample,tries", CASES, ids=[c[0] for c in CASES])
def test_the_range_checked_program_raises_exactly_where_eager_raises(what, fn, sample, tries):
    ep = exported(fn, X, torch.tensor(sample))
    original = ep.module()
    report = bound_program(ep, negative_ids=False, device="cpu")
    assert report.facts()["range_checked"]["count"] >= 1, what
    checked = ep.module()
    for i in tries:
        assert agree(outcome(checked, X, torch.tensor(i)), outcome(original, X, torch.tensor(i))), (what, i)
    # What the compile sees: the re-export keeps one assert per index, with our message.
    again = torch.export.export(checked, (X, torch.tensor(sample)))
    messages = [n.args[1] for n in again.graph.nodes if n.target is aten._assert_async.msg]
    assert messages and all(m.startswith("index out of bounds: ") for m in messages), what


def test_a_cuda_target_gets_no_range_checks():
    ep = exported(lambda x, i: F.embedding(i, x), X, torch.tensor([0, 1]))
    before = ep.graph_module.code
    assert "range_checked" not in bound_program(ep, negative_ids=False, device="cuda").facts()
    assert ep.graph_module.code == before


# -- a real package, called by a server that must live on ---------------------------------------------------------

class Served(torch.nn.Module):
    """Token ids through an embedding (vocab 1000), positions through a table (index.Tensor), and a loss over class
    labels: three indices from the caller. 32 x 256 ids: Inductor runs the lookup in parallel (#pragma omp)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(1000, 64)
        self.pos = torch.nn.Parameter(torch.randn(512, 64))
        self.head = torch.nn.Linear(64, 16)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = self.head(torch.tanh(self.emb(ids) + self.pos[positions]).mean(1))
        return logits, F.cross_entropy(logits, labels, reduction="none")


SERVED_SPEC = [{"name": "ids", "dtype": "int64", "shape": [32, 256]},
               {"name": "positions", "dtype": "int64", "shape": [32, 256]},
               {"name": "labels", "dtype": "int64", "shape": [32]}]


def served_inputs(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 1000, (32, 256), generator=g), torch.randint(0, 512, (32, 256), generator=g),
            torch.randint(0, 16, (32,), generator=g))


# What a server does: load with the SDK's loader, answer a hostile request with an error, serve the next one.
SERVER = """
import sys, torch
from compiler.compat.aoti import aoti_load_package
sys.path[:0] = ["tests/compiler", "tests"]
from test_ranges import served_inputs
package = aoti_load_package(sys.argv[1], "cpu")
ids, positions, labels = served_inputs(1)
hostile = {"id 1000": (ids.index_put((torch.tensor([5]), torch.tensor([7])), torch.tensor(1000)), positions, labels),
           "id -1": (torch.full_like(ids, -1), positions, labels),
           "position 512": (ids, positions.index_put((torch.tensor([31]), torch.tensor([255])), torch.tensor(512)),
                            labels),
           "label 16": (ids, positions, labels.index_put((torch.tensor([3]),), torch.tensor(16))),
           "label -1": (ids, positions, torch.full_like(labels, -1))}
for what, args in hostile.items():
    print(what, flush=True)
    try:
        package(*args)
        print("returned", flush=True)
    except RuntimeError as e:
        print("raised", str(e).replace(chr(10), " ")[:2000], flush=True)
    logits, loss = package(ids, positions, labels)
    torch.save((logits, loss), sys.argv[2] + "-" + what.replace(" ", "_") + ".pt")
print("served", flush=True)
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from compiler.options import CompileOptions
    from compiler.pipeline import compile_model
    from modelzoo import export, seeded

    d = tmp_path_factory.mktemp("served")
    model = seeded(Served, 7).eval()
    path = export(model, served_inputs(0), d / "m.pt2")
    result = compile_model(str(path), SERVED_SPEC, SERVED_SPEC, CompileOptions(), "cpu", str(d / "p.pt2"))
    return {"model": model, "package": result["package"], "dir": d}


def parallel_and_serial_lines(source: str) -> tuple[int, list[str]]:
    """(how many `#pragma omp parallel` regions, the lines that lie inside none of them)."""
    regions, depth, opens, outside, pending = 0, 0, [], [], False
    for line in source.splitlines():
        stripped = line.strip()
        if stripped.startswith("#pragma omp parallel"):
            regions, pending = regions + 1, True
            continue
        if not opens:
            outside.append(line)
        for ch in stripped:
            if ch == "{":
                depth += 1
                if pending:
                    opens.append(depth)
                    pending = False
            elif ch == "}":
                if opens and opens[-1] == depth:
                    opens.pop()
                depth -= 1
    return regions, outside


@pytest.mark.slow
def test_a_hostile_index_raises_in_the_callers_process_which_serves_the_next_request(served):
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    with zipfile.ZipFile(served["package"]) as zf:
        kernels = "\n".join(zf.read(n).decode() for n in zf.namelist() if n.endswith(".kernel.cpp"))
    regions, outside = parallel_and_serial_lines(kernels)
    ours = [line for line in kernels.splitlines() if "(checked before the kernel)" in line]
    assert regions > 0, "the kernels run in parallel"
    assert len(ours) == 3 and all(line in outside for line in ours)  # ids, positions, labels: outside every region

    proc = subprocess.run([sys.executable, "-c", SERVER, served["package"], str(served["dir"] / "out")],
                          capture_output=True, text=True, cwd=root, timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = proc.stdout.splitlines()
    said = dict(zip(lines[0:-1:2], lines[1::2], strict=True))
    assert lines[-1] == "served"
    bounds = {"id 1000": "ids of aten.embedding.default (rows of the table) must lie in 0..999",
              "id -1": "ids of aten.embedding.default (rows of the table) must lie in 0..999",
              "position 512": "index 0 of aten.index.Tensor (dim 0) must lie in -512..511",
              "label 16": "class target of aten.cross_entropy_loss.default must lie in 0..15 or be -100",
              "label -1": "class target of aten.cross_entropy_loss.default must lie in 0..15 or be -100"}
    for what, bound in bounds.items():
        assert said[what].startswith("raised") and bound in said[what], (what, said[what])

    # In range, before and after each refusal: eager's answer.
    with torch.inference_mode():
        want = served["model"](*served_inputs(1))
    for what in bounds:
        got = torch.load(served["dir"] / f"out-{what.replace(' ', '_')}.pt")
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
