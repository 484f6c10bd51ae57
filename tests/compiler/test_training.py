"""Train-step packages (compiler/training.py, compiler/traincheck.py, compiler/compat/joint.py): the joint program's
roles, the user's mistakes named, and the training check catching packages that freeze what training updates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from compiler import cachekey
from compiler import weights as weights_mod
from compiler.compat.aoti import TRAIN_METADATA, LoadedPackage, aoti_compile_and_package, weightless_configs
from compiler.compat.joint import (
    LossOutputError,
    attends_on_cpu,
    joint_program,
    misfed_cpu_attention,
    random_ops,
    roles,
    run_op_by_op,
)
from compiler.errors import CheckFailed
from compiler.options import TRAINING_INDUCTOR_CONFIGS, CompileOptions
from compiler.shapes import training_refusal
from compiler.traincheck import check_training
from modelzoo import TrainMLP, export_train, seeded

SPEC = [{"name": "x", "dtype": "float32", "shape": [6, 8]}, {"name": "y", "dtype": "float32", "shape": [6, 4]}]
ARGS = (torch.randn(6, 8), torch.randn(6, 4))


class TwoOutputs(torch.nn.Module):
    """(logits, loss), the logits NOT detached."""

    def __init__(self) -> None:
        super().__init__()
        self.l = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.l(x)
        return out, torch.nn.functional.mse_loss(out, y)


@pytest.fixture(scope="module")
def mlp(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = tmp_path_factory.mktemp("train")
    path = export_train(seeded(TrainMLP, 5), ARGS, d / "mlp.pt2")
    return {"dir": d, "path": path, "ep": torch.export.load(str(path))}


def test_roles_are_the_loss_the_other_outputs_and_a_grad_per_parameter(mlp):
    got, mutated = roles(joint_program(mlp["ep"], 0))
    assert [r.role for r in got][:2] == ["loss", "output:0"]
    assert sorted(r.role for r in got[2:]) == sorted(f"grad:{n}" for n, _ in TrainMLP().named_parameters())
    assert [r.index for r in got] == list(range(len(got)))
    assert mutated == ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]


def test_the_users_mistakes_are_named(mlp):
    with pytest.raises(LossOutputError, match=r"options.loss_output is 2, but the program has 2 output\(s\) \(0..1\)"):
        joint_program(mlp["ep"], 2)
    with pytest.raises(LossOutputError, match=r"must be a floating scalar; it is torch.float32 of shape \[6, 4\]"):
        joint_program(mlp["ep"], 1)
    ep = torch.export.export(TwoOutputs().train(), ARGS)
    with pytest.raises(LossOutputError, match=r"needs a gradient: return the other outputs detached"):
        joint_program(ep, 1)


class Dropped(torch.nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.l = torch.nn.Linear(8, 4)
        self.drop = torch.nn.Dropout(p)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.drop(self.l(x)), y)


class DroppedMLP(torch.nn.Module):
    """(loss, logits detached) with dropout at p=0.3 between two layers: a step that draws random numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.l2(self.drop(torch.relu(self.l1(x))))
        return torch.nn.functional.mse_loss(out, y), out.detach()


@pytest.mark.slow
def test_a_step_with_dropout_is_checked_against_eager_and_one_built_on_inductors_generator_fails(tmp_path):
    """Dropout draws from torch's generator in eager. Built as aotc builds train steps (fallback_random), the package
    draws the same masks after the same seed: the check compares its steps and passes. Built on Inductor's own
    Philox seeds (torch's default), the masks differ and the check fails: the check really compares the draws."""
    assert [d.split(" ")[0] for d in random_ops(torch.export.export(Dropped(0.1).train(), ARGS))] == [
        "aten.dropout.default"]
    assert random_ops(torch.export.export(Dropped(0.0).train(), ARGS)) == []
    path = export_train(seeded(DroppedMLP, 3), ARGS, tmp_path / "dropped.pt2")
    mlp = {"dir": tmp_path, "path": path}
    configs = {**(weightless_configs() or {}), **TRAINING_INDUCTOR_CONFIGS}
    assert configs["fallback_random"] is True
    checked = check_training(str(path), _broken_build(mlp, "seeded.pt2", configs), SPEC, "cpu", adversarial=False)
    seeded_ops = [d.split(" ")[0] for d in checked["training"]["random_ops"]]
    assert checked["passed"] and seeded_ops == ["aten.dropout.default"]
    assert all(s["max_grad_rel_err"] < 1e-4 and s["fp64_passed"] == {}  # fp32 agrees: no second opinion needed
               for s in checked["training"]["steps"]), checked["training"]["steps"]
    own = _broken_build(mlp, "philox.pt2", {**configs, "fallback_random": False})
    with pytest.raises(CheckFailed, match=r"step 1 of 3: .* disagrees with eager"):
        check_training(str(path), own, SPEC, "cpu", adversarial=False)


def test_the_float64_second_opinion_passes_eagers_own_rounding_and_refuses_a_wrong_gradient():
    """A failed gradient is judged again against a float64 run (compiler.traincheck._second_opinion): within 3x
    eager's own distance from it (plus the tolerance) it passes, further it fails, and either way the record has
    the max-element and root-mean-square distances of both sides (efficientnet_b0's refusal on the H200s named only
    the largest element)."""
    from compiler.compat.joint import Role
    from compiler.traincheck import _second_opinion, grad_scales

    eager = seeded(TrainMLP, 5).train()
    buffers = {n: b.clone() for n, b in eager.named_buffers()}
    flat = list(eager(*ARGS))
    flat[0].backward()
    params = dict(eager.named_parameters())
    roles = [Role("loss", 0), Role("output:0", 1)] + [Role(f"grad:{n}", 2 + i) for i, n in enumerate(params)]
    scales = grad_scales({n: p.grad for n, p in params.items()})
    failed = {"what": "grad:l2.bias", "ok": False, "why": "output 0 (torch.float32) is off by 0.3 relative to eager"}

    def judged(shift: float, what: dict = failed, var_shift: float = 0.0) -> dict:
        got = [flat[0].detach(), flat[1].detach()] + [p.grad.clone() for p in params.values()]
        got[2 + list(params).index("l2.bias")] += shift
        live = {n: b.clone() for n, b in eager.named_buffers()}  # the package's buffers after its step
        live["bn.running_var"] += var_shift
        return _second_opinion([dict(what)], eager, ARGS, {}, 0, flat, got, roles, scales, 0.0, 0, buffers, live,
                               0.2)[0]

    same = judged(0.0)  # eager's own values: as far from float64 as eager is
    assert same["ok"] and same["fp64"]["package"] == pytest.approx(same["fp64"]["eager"])
    assert same["fp64"]["rmse"]["package"] == pytest.approx(same["fp64"]["rmse"]["eager"])
    wrong = judged(0.5 * scales["l2.bias"])
    assert not wrong["ok"] and wrong["fp64"]["package"] > wrong["fp64"]["bound"]
    assert wrong["fp64"]["rmse"]["package"] > 100 * wrong["fp64"]["rmse"]["eager"]
    assert "root-mean-square: the package" in wrong["why"] and "against float64 the package is off by" in wrong["why"]
    # A buffer the step updates is judged from the buffers as they were before the step: eager's own update passes
    # (float64's running_var is eager's up to rounding), one 0.5 off (a tolerance of 0.2 at most 1) fails.
    var = {"what": "buffer:bn.running_var", "ok": False, "why": "output 0 (torch.float32) is off by 0.3 relative"}
    same = judged(0.0, var)
    assert same["ok"] and same["fp64"]["package"] == pytest.approx(same["fp64"]["eager"])
    assert same["fp64"]["eager"] < 1e-6
    wrong = judged(0.0, var, var_shift=0.5)
    assert not wrong["ok"] and wrong["fp64"]["package"] == pytest.approx(0.5 / max(1.0, float(
        eager.bn.running_var.abs().max())), rel=1e-3)
    # Where the float64 run cannot be made, the first judgment stands and says why; a passed check is untouched.
    eager.forward = float32_only(eager.forward)
    passed = {"what": "loss", "ok": True, "why": None}
    kept, stood = _second_opinion([passed, dict(failed)], eager, ARGS, {}, 0, flat, flat, roles, scales, 0.0, 0,
                                  buffers, buffers, 0.2)
    assert kept == passed and not stood["ok"] and "fp64" not in stood
    assert stood["why"] == f"{failed['why']}; no float64 second opinion: TypeError: float32 inputs only"


def float32_only(forward):
    def guarded(x: torch.Tensor, y: torch.Tensor):
        if x.dtype != torch.float32:  # as a model that casts with a fixed dtype, or an op without a float64 kernel
            raise TypeError("float32 inputs only\n(second line)")
        return forward(x, y)
    return guarded


def test_training_options_key_and_shapes():
    with pytest.raises(ValueError, match="loss_output names the loss of a training step: it needs mode=training"):
        CompileOptions(loss_output=1)
    training = CompileOptions(mode="training")
    assert training.weightless
    assert training.inductor_configs()["joint_graph_constant_folding"] is False
    assert "joint_graph_constant_folding" not in CompileOptions().inductor_configs()

    def key(o: CompileOptions) -> str:
        return cachekey.cache_key(cachekey.factors("ab" * 32, SPEC, "cpu-x86_64-v3", {"torch": "2.13"},
                                                      o.canonical()))

    assert len({key(CompileOptions()), key(training), key(CompileOptions(mode="training", loss_output=1))}) == 3
    assert "loss_output" not in CompileOptions().canonical()  # inference keys are unchanged
    built = cachekey.factors("ab" * 32, SPEC, "cpu-x86_64-v3", {"torch": "2.13"}, training.canonical())
    assert built["training"]["inductor"] == {"joint_graph_constant_folding": False, "fallback_random": True}
    assert "training" not in cachekey.factors("ab" * 32, SPEC, "cpu-x86_64-v3", {"torch": "2.13"},
                                              CompileOptions().canonical())
    assert training_refusal(SPEC) is None
    dyn = [{"name": "x", "dtype": "float32", "shape": [{"min": 1, "max": 8}, 8]}]
    assert training_refusal(dyn) == ("mode=training takes static shapes: input 'x' dim 0 is a range 1..8; give one "
                                     "size (one package per batch shape)")


def _broken_build(mlp: dict, name: str, configs: dict) -> str:
    """A train-step package built as aotc does NOT build one: the joint program with `configs`."""
    ep = torch.export.load(str(mlp["path"]))
    package = str(Path(mlp["dir"]) / name)
    aoti_compile_and_package(joint_program(ep, 0), package, {**CompileOptions().inductor_configs(), **configs})
    weights_mod.save(weights_mod.program_weights(torch.export.load(str(mlp["path"]))), weights_mod.sidecar(package))
    return package


@pytest.mark.slow
def test_a_package_that_freezes_a_buffer_fails_naming_it(mlp):
    """Weightless, small constants kept, but Inductor's joint-graph constant folding left on (what the training
    options turn off): BatchNorm's 0-d batch count is folded to `= 1`, written on every step while eager counts on."""
    weightless = weightless_configs()
    assert weightless is not None
    assert not set(TRAINING_INDUCTOR_CONFIGS) & set(weightless)
    package = _broken_build(mlp, "folded.pt2", weightless)
    with pytest.raises(CheckFailed, match=r"step 2 of 3: buffer 'bn.num_batches_tracked' was not updated in place"):
        check_training(str(mlp["path"]), package, SPEC, "cpu")


@pytest.mark.slow
def test_a_package_that_freezes_a_parameter_fails_naming_it(mlp):
    """Without always_keep_tensor_constants, Inductor inlines the 1-element `scale` and the 4-element `l2.bias` as
    literals: the package would train on with both frozen at their first values."""
    configs = {**(weightless_configs() or {}), **TRAINING_INDUCTOR_CONFIGS, "always_keep_tensor_constants": False}
    package = _broken_build(mlp, "inlined.pt2", configs)
    frozen = r"does not read weight 'l2.bias' .*: scale\): it was frozen into the generated code"
    with pytest.raises(CheckFailed, match=frozen):
        check_training(str(mlp["path"]), package, SPEC, "cpu")


def test_the_parameter_write_check_compares_bits():
    """A NaN weight is the same weight (torch.equal says no), a 0-d parameter and a transposed view compare, and one
    bit moved is a write."""
    from compiler.traincheck import same_bits

    nan = torch.tensor([1.0, float("nan")])
    assert same_bits(nan, nan.clone()) and not torch.equal(nan, nan.clone())
    assert same_bits(torch.tensor(0.5), torch.tensor(0.5)) and not same_bits(torch.tensor(0.5), torch.tensor(0.25))
    assert same_bits(torch.arange(6.0).view(2, 3).t(), torch.arange(6.0).view(2, 3).t().contiguous())
    moved = torch.ones(4)
    moved.view(torch.int32)[2] += 1  # the last bit of one element
    assert not same_bits(torch.ones(4), moved)
    assert not same_bits(torch.ones(4), torch.ones(4, dtype=torch.float64))


@pytest.mark.slow
def test_each_step_starts_from_eagers_state_and_a_package_that_writes_a_parameter_is_refused(mlp, monkeypatch):
    """Two correct implementations differ by rounding, and when each steered its own weights a network amplified
    that step after step: here gradients 5e-5 from eager's (half the float32 tolerance) at every step were refused
    at step 2 with lr=1 (the loss 2e-4 off), as bf16 CNNs' were on H200s (bench/train_drift.py). Each step now
    starts both sides from eager's weights and buffers, so every step passes. A package that writes to the caller's
    parameters (it may write only the buffers its manifest names) is named, and one that reads its own copy of the
    weights (the caller's updates never reach it) fails the next step."""
    package = _broken_build(mlp, "good.pt2", {**(weightless_configs() or {}), **TRAINING_INDUCTOR_CONFIGS})
    real_run, real_bind = LoadedPackage.run_flat, LoadedPackage.bind_constants
    bound: dict[str, torch.Tensor] = {}

    def bind(self: LoadedPackage, constants: dict[str, torch.Tensor]) -> None:
        bound.update(constants)
        real_bind(self, constants)

    def rounded(self: LoadedPackage, flat: list[torch.Tensor]) -> list[torch.Tensor]:
        out = real_run(self, flat)
        return out[:2] + [g * (1 + 5e-5) for g in out[2:]]  # loss, logits, then a gradient per parameter

    monkeypatch.setattr(LoadedPackage, "bind_constants", bind)
    monkeypatch.setattr(LoadedPackage, "run_flat", rounded)
    checked = check_training(str(mlp["path"]), package, SPEC, "cpu", lr=1.0, adversarial=False)
    assert [s["max_grad_rel_err"] == pytest.approx(5e-5, rel=0.05) for s in checked["training"]["steps"]] == [True] * 3

    def writes(self: LoadedPackage, flat: list[torch.Tensor]) -> list[torch.Tensor]:
        out = real_run(self, flat)
        bound["l2.weight"].add_(1e-3)  # the caller's own tensor: its weights moved by the package
        return out

    monkeypatch.setattr(LoadedPackage, "run_flat", writes)
    with pytest.raises(CheckFailed, match=r"step 1 of 3: the package wrote to parameter\(s\) \['l2.weight'\] of the "):
        check_training(str(mlp["path"]), package, SPEC, "cpu", adversarial=False)

    weights = {n for n, _ in TrainMLP().named_parameters()}

    def copies(self: LoadedPackage, constants: dict[str, torch.Tensor]) -> None:  # its own copy of the weights
        real_bind(self, {k: v.clone() if k in weights else v for k, v in constants.items()})

    monkeypatch.setattr(LoadedPackage, "run_flat", real_run)
    monkeypatch.setattr(LoadedPackage, "bind_constants", copies)
    with pytest.raises(CheckFailed, match=r"step 2 of 3: .* disagrees with eager: .*step 1 agreed: a parameter the "
                                          r"package does not read from the bound tensors"):
        check_training(str(mlp["path"]), package, SPEC, "cpu", adversarial=False)


def test_a_train_step_is_never_served_as_a_model_nor_the_reverse():
    """Lookup and the pick by name: an inference load never gets a train step (its outputs are not the model's), and
    Client.load_training never gets an inference package; each rejected candidate says why."""
    from compiler.targets import Target
    from service.api.lookup import rank
    from service.api.pick import pick

    def record(options: CompileOptions, created: float) -> dict:
        f = cachekey.factors("ab" * 32, SPEC, "cpu-x86_64-v3", {"torch": "2.13"}, options.canonical())
        return {"key": cachekey.cache_key(f), "factors": f, "created": created}

    infer, step = record(CompileOptions(), 1.0), record(CompileOptions(mode="training"), 2.0)  # the step is newer
    host = Target.parse("cpu-x86_64-v3")
    assert rank([infer, step], Target.parse("cpu"), SPEC)["key"] == infer["key"]
    assert rank([infer, step], Target.parse("cpu"), SPEC, mode="training")["key"] == step["key"]
    assert rank([step], Target.parse("cpu"), SPEC) is None
    got = pick([infer, step], host, spec=SPEC)
    assert got.artifact["key"] == infer["key"]
    assert ["a train step (mode=training): load it with Client.load_training"] in [r["why"] for r in got.rejected]
    got = pick([infer, step], host, spec=SPEC, training=True)
    assert got.artifact["key"] == step["key"]
    assert ["not a train step: Client.load_training takes a mode=training package"] in [r["why"] for r in got.rejected]


@pytest.mark.slow
def test_precision_bf16_is_autocast_checked_in_bf16_and_weights_stay_fp32(mlp):
    """precision=bf16 with mode=training: the step runs under torch.autocast (casts traced into the graph), the weights
    blob and the gradients stay float32, and the check compares with eager under the same autocast."""
    from compiler.pipeline import compile_model

    out = str(Path(mlp["dir"]) / "bf16" / "artifact.pt2")
    Path(out).parent.mkdir()
    got = compile_model(str(mlp["path"]), SPEC, SPEC, CompileOptions(mode="training", precision="bf16"), "cpu", out)
    blob = weights_mod.load(got["weights"])
    assert {t.dtype for t in blob.values() if t.is_floating_point()} == {torch.float32}
    summary = check_training(str(mlp["path"]), got["package"], SPEC, "cpu", precision="bf16")
    assert summary["training"]["autocast"] == "bfloat16" and summary["precision"] == "bf16"
    assert len(summary["training"]["steps"]) == 3
    # Computed in bf16: the loss is not fp32 eager's (a package that ignored autocast would match it to 1e-7).
    ep = torch.export.load(str(mlp["path"]))
    torch.manual_seed(0)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    from compiler.compat.aoti import LoadedPackage
    from compiler.traincheck import live_tensors

    package = LoadedPackage(got["package"], "cpu")
    module = ep.module()
    package.bind_constants({k: v for k, v in live_tensors(module).items() if k in package.get_constant_fqns()})
    loss = package.run_flat([x, y])[0]
    with torch.no_grad():
        fp32 = ep.module()(x, y)[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            amp = ep.module()(x, y)[0]
    assert abs(float(loss) - float(fp32)) > 1e-5 and abs(float(loss) - float(amp)) < 5e-2 * max(abs(float(amp)), 1)



class Attends(torch.nn.Module):
    """Self-attention through scaled_dot_product_attention, two heads, its keys and values from every fourth token
    (SegFormer's reduced sequence): (loss, output detached)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, n, c = x.shape
        kv = x[:, ::4]
        q = self.q(x).view(b, n, 2, c // 2).transpose(1, 2)
        k = self.k(kv).view(b, -1, 2, c // 2).transpose(1, 2)
        v = self.v(kv).view(b, -1, 2, c // 2).transpose(1, 2)
        out = self.o(torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))
        return torch.nn.functional.mse_loss(out, y), out.detach()


ATTENDS_SPEC = [{"name": "x", "dtype": "float32", "shape": [2, 16, 16]},
                {"name": "y", "dtype": "float32", "shape": [2, 16, 16]}]


def _joint_gradients(joint: torch.export.ExportedProgram, args: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    """The joint program run op by op with ATen's kernels (no Inductor): its gradients by parameter."""
    got, _ = roles(joint)
    flat = run_op_by_op(joint, args)
    return {r.role.removeprefix("grad:"): flat[r.index] for r in got if r.role.startswith("grad:")}


def test_attention_on_a_cpu_gets_eagers_gradients_from_the_joint_program(monkeypatch):
    """torch's export decomposes the CPU attention kernel's forward into its math form, with the attention weights
    where the kernel returns its logsumexp, and keeps the kernel's derivative, which reads them as one
    (compiler.compat.joint.CPU_ATTENTION): every gradient through the attention was wrong in float32 (a SegFormer-B0
    train step's by 1e9 of their scale) and refused in bf16. The joint keeps the kernel: its gradients are eager's."""
    from torch.export.experimental import _export_forward_backward

    from compiler.compat import joint as joint_mod

    model = seeded(Attends, 3).train()
    args = (torch.randn(2, 16, 16), torch.randn(2, 16, 16))
    model(*args)[0].backward()
    eager = {n: p.grad for n, p in model.named_parameters()}
    ep = torch.export.export(model, args)

    def worst(grads: dict[str, torch.Tensor]) -> float:
        assert set(grads) == set(eager)
        return max(float((grads[n] - g).abs().max() / g.abs().max()) for n, g in eager.items())

    assert attends_on_cpu(ep) and not attends_on_cpu(torch.export.export(seeded(TrainMLP, 5), ARGS))
    joint = joint_program(ep, 0)
    assert misfed_cpu_attention(joint) == []
    assert worst(_joint_gradients(joint, args)) < 1e-5
    # torch's own joint, judged by the same detector: where it hands the kernel the weights, its gradients are far off
    # (torch 2.13 does); where it does not (a later torch), they are eager's.
    stock = _export_forward_backward(ep, joint_loss_index=0)
    misfed = bool(misfed_cpu_attention(stock))
    assert misfed == (worst(_joint_gradients(stock, args)) > 1e-2)
    if misfed:  # a torch whose private pieces the fused path cannot use gets the stock joint, refused by name
        monkeypatch.setattr(joint_mod, "_fused_cpu_attention_joint", lambda ep, loss_output: None)
        with pytest.raises(joint_mod.JointUnavailable, match=r"attention weights for its logsumexp \(at "):
            joint_program(ep, 0)


@pytest.mark.slow
def test_a_bf16_attention_train_step_builds_and_passes_the_check_on_a_cpu(tmp_path):
    """Refused before at the autograd stage (`expected scalar type Float but found BFloat16`: the same misfed
    logsumexp, in bf16): now the report's trace, the package and its three-step check all go through."""
    from compiler.pipeline import compile_model

    path = export_train(seeded(Attends, 3), (torch.randn(2, 16, 16), torch.randn(2, 16, 16)), tmp_path / "att.pt2")
    options = CompileOptions(mode="training", precision="bf16")
    got = compile_model(str(path), ATTENDS_SPEC, ATTENDS_SPEC, options, "cpu", str(tmp_path / "artifact.pt2"))
    summary = check_training(str(path), got["package"], ATTENDS_SPEC, "cpu", precision="bf16")
    assert summary["training"]["autocast"] == "bfloat16" and len(summary["training"]["steps"]) == 3
    assert all(s["max_grad_rel_err"] < 0.05 for s in summary["training"]["steps"]), summary["training"]["steps"]


class TrainLookup(torch.nn.Module):
    """A train step that reads a table at token ids (its input): (loss, outputs detached)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(10, 8))
        self.l = torch.nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.l(self.table[ids])
        return torch.nn.functional.mse_loss(out, y), out.detach()


@pytest.mark.slow
def test_a_train_step_that_reads_out_of_bounds_at_hostile_ids_fails_the_adversarial_check(tmp_path):
    """The training check feeds ids at and beyond the table's bounds, as a later caller could: built with the index
    asserts every compile forces, the package raises where eager raises and passes; built without them, it reads
    past the table and fails, naming the case."""
    ids = torch.arange(6) % 10
    path = export_train(seeded(TrainLookup, 1), (ids, torch.randn(6, 4)), tmp_path / "lookup.pt2")
    mlp = {"dir": tmp_path, "path": path}
    spec = [{"name": "ids", "dtype": "int64", "shape": [6]}, {"name": "y", "dtype": "float32", "shape": [6, 4]}]
    configs = {**(weightless_configs() or {}), **TRAINING_INDUCTOR_CONFIGS}
    # marked a train step as compiler.stages marks one: the probes run it flat
    configs["aot_inductor.metadata"] = {**configs.get("aot_inductor.metadata", {}), TRAIN_METADATA: "0"}
    checked = check_training(str(path), _broken_build(mlp, "bounded.pt2", configs), spec, "cpu")
    assert checked["adversarial"]["cases"] > 0 and not checked["adversarial"]["failures"], checked["adversarial"]
    unbounded = {**configs, "assert_indirect_indexing": False, "debug_index_asserts": False}
    with pytest.raises(CheckFailed, match=r"train-step package fails the adversarial check: "):
        check_training(str(path), _broken_build(mlp, "unbounded.pt2", unbounded), spec, "cpu")


class Cancels(torch.nn.Module):
    """Logits that bf16 rounds away: each embedding row is (1001, -1000), and every class weighs both columns alike,
    so fp32 gives logit c_j and bf16 (1001 rounds to 1000) gives 0. Ids and labels: the adversarial check runs."""

    def __init__(self) -> None:
        super().__init__()
        self.e = torch.nn.Embedding(10, 2)
        self.head = torch.nn.Linear(2, 5)
        with torch.no_grad():
            self.e.weight.copy_(torch.tensor([1001.0, -1000.0]).expand(10, 2))
            self.head.weight.copy_(torch.arange(1.0, 6.0)[:, None].expand(5, 2))
            self.head.bias.zero_()

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(self.e(ids).mean(dim=1)).float()
        return torch.nn.functional.cross_entropy(logits, labels), logits.detach()


@pytest.mark.slow
def test_the_adversarial_probes_run_eager_in_the_steps_precision(tmp_path):
    """A bf16 train step's probes compared its outputs with eager in float32, while its training check ran eager
    under bf16 autocast: resnet50's step passed three steps and was then refused on an H200 ("input 'labels' = 512
    ...: output 1 is off by 0.13 relative to eager; tolerance 0.05"), at an in-range label. Here fp32 and bf16
    logits are 100 % apart; eager under the step's autocast agrees with the package at every case."""
    from compiler.pipeline import compile_model

    ids, labels = torch.randint(0, 10, (6, 3)), torch.randint(0, 5, (6,))
    model = Cancels().train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert float(model(ids, labels)[1].abs().max()) == 0.0
    assert float(model(ids, labels)[1].abs().min()) >= 1.0  # fp32
    path = export_train(model, (ids, labels), tmp_path / "cancels.pt2")
    spec = [{"name": "ids", "dtype": "int64", "shape": [6, 3]}, {"name": "labels", "dtype": "int64", "shape": [6]}]
    got = compile_model(str(path), spec, spec, CompileOptions(mode="training", precision="bf16"), "cpu",
                        str(tmp_path / "a.pt2"))
    checked = check_training(str(path), got["package"], spec, "cpu", precision="bf16")
    found = checked["adversarial"]
    assert found["outcomes"].get("agreed", 0) > 0 and not found["failures"], found["outcomes"]


class Pooled(torch.nn.Module):
    """What a BERT under a user's own head looks like: a pooler computed and unused by the loss, a side head feeding
    only a detached output, and logits made float32 (`.float()`, export asserts their export-time dtype) before the
    loss."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(8, 16)
        self.pool = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 4)
        self.side = torch.nn.Linear(16, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = torch.relu(self.body(x))
        pooled = torch.tanh(self.pool(h))
        logits = self.head(h).float()
        return torch.nn.functional.mse_loss(logits, y), self.side(h).detach(), pooled.detach()


NO_GRAD = ["pool.weight", "pool.bias", "side.weight", "side.bias"]


@pytest.fixture(scope="module")
def pooled(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Pooled built as aotc builds it: mode=training, precision=bf16 (autocast), on the CPU."""
    from compiler.pipeline import compile_model

    d = tmp_path_factory.mktemp("pooled")
    path = export_train(seeded(Pooled, 3), ARGS, d / "pooled.pt2")
    got = compile_model(str(path), SPEC, SPEC, CompileOptions(mode="training", precision="bf16"), "cpu",
                        str(d / "artifact.pt2"))
    return {"dir": d, "path": path, "built": got}


@pytest.mark.slow
def test_parameters_the_loss_does_not_use_get_no_gradient_as_in_eager_and_float_casts_survive_autocast(pooled):
    """AOTAutograd asserts that every parameter receives a gradient, which refused BERT (its pooler) on an H100;
    export's dtype assert before `.float()` refused every zoo model under bf16 autocast. Both build now: the manifest
    names the parameters with no gradient, and the check proves eager's backward leaves their .grad None."""
    import json

    step = json.loads(Path(pooled["built"]["report"]).read_text())["stages"]["autograd"]["train_step"]
    assert step["no_grad"] == NO_GRAD
    assert [r["role"] for r in step["outputs"]] == ["loss", "output:0", "output:1", "grad:body.weight",
                                                    "grad:body.bias", "grad:head.weight", "grad:head.bias"]
    summary = check_training(str(pooled["path"]), pooled["built"]["package"], SPEC, "cpu", precision="bf16")
    assert summary["passed"] and summary["training"]["no_grad"] == NO_GRAD
    assert len(summary["training"]["steps"]) == 3


@pytest.mark.slow
def test_a_parameter_said_to_get_no_gradient_that_eager_gives_one_fails_the_check(pooled, monkeypatch):
    """The manifest's no_grad comes from a walk of the graph (compiler.compat.joint.no_gradient); were the walk
    wrong, the package would leave a trained parameter's .grad unset. The check catches it against eager's backward,
    naming the parameter (the package here built, and checked, with such a walk)."""
    from compiler.compat import joint

    walk = joint.no_gradient
    monkeypatch.setattr(joint, "no_gradient", lambda ep, i: [*walk(ep, i), "head.bias"])
    configs = {**(weightless_configs() or {}), **TRAINING_INDUCTOR_CONFIGS}
    configs["aot_inductor.metadata"] = {**configs.get("aot_inductor.metadata", {}), TRAIN_METADATA: "0"}
    wrong = _broken_build(pooled, "wrong-walk.pt2", configs)
    with pytest.raises(CheckFailed, match=r"eager's backward gives parameter\(s\) \['head.bias'\] a gradient"):
        check_training(str(pooled["path"]), wrong, SPEC, "cpu", adversarial=False)


class DepthDropped(torch.nn.Module):
    """torchvision's StochasticDepth, row mode: a per-sample keep mask drawn with `bernoulli_`."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.l1(x)
        keep = torch.empty([x.shape[0], 1], dtype=x.dtype, device=x.device).bernoulli_(0.8).div_(0.8)
        out = self.l2(x + h * keep)
        return torch.nn.functional.mse_loss(out, y), out.detach()


@pytest.mark.slow
def test_a_step_that_draws_with_bernoulli_builds_with_its_error_code_checked(tmp_path):
    """A train step keeps `bernoulli_` as an ATen call (fallback_random), whose C++ wrapper line dropped the shim's
    error code, and compiler.scan refused every such package (an EfficientNet's on an H100). The line is checked now
    (compiler.compat.shims), the package builds, and the check compares its seeded draws with eager's."""
    from compiler.pipeline import compile_model

    path = export_train(seeded(DepthDropped, 2), ARGS, tmp_path / "depth.pt2")
    got = compile_model(str(path), SPEC, SPEC, CompileOptions(mode="training"), "cpu", str(tmp_path / "a.pt2"))
    import json

    hooks = json.loads(Path(got["report"]).read_text())["hooks"]
    assert "InplaceBernoulliFallback.codegen" in hooks["checked_fallbacks"]
    checked = check_training(str(path), got["package"], SPEC, "cpu", adversarial=False)
    assert checked["passed"] and [d.split(" ")[0] for d in checked["training"]["random_ops"]] == [
        "aten.bernoulli_.float"]


@pytest.mark.slow
def test_a_frozen_layer_gets_no_gradient_and_the_rest_train(tmp_path):
    """Fine-tuning: the upload's first layer has requires_grad=False. Its parameters get no gradient output (the
    manifest's no_grad), the others do, and the check passes; before, it failed ("the package returns no gradient
    for parameter(s) ['l1.bias', 'l1.weight']")."""
    from compiler.pipeline import compile_model

    model = seeded(TrainMLP, 5)
    for p in model.l1.parameters():
        p.requires_grad_(False)
    path = export_train(model, ARGS, tmp_path / "frozen.pt2")
    got = compile_model(str(path), SPEC, SPEC, CompileOptions(mode="training"), "cpu", str(tmp_path / "a.pt2"))
    checked = check_training(str(path), got["package"], SPEC, "cpu", adversarial=False)
    assert checked["passed"] and checked["training"]["no_grad"] == ["l1.weight", "l1.bias"]
    assert {r["role"] for r in checked["training"]["outputs"]} == {
        "loss", "output:0", "grad:scale", "grad:bn.weight", "grad:bn.bias", "grad:l2.weight", "grad:l2.bias"}


@pytest.mark.slow
def test_a_step_whose_model_writes_literals_into_a_tensor_builds_and_passes(tmp_path):
    """torchvision's swin_t on an H100 was refused: "the package does not read weight
    'body.features.1.1.attn.lifted_tensor_0' from its weights blob (nor 44 more)", the shifted-window mask's
    literals, which the train step had turned into Inductor constants no caller binds. They are ops now
    (compiler.specialize.inline_literals): the package reads the parameters and the buffer only, and the step
    matches eager's loss and gradients."""
    from compiler.pipeline import compile_model
    from modelzoo import ShiftedMask

    path = export_train(seeded(ShiftedMask, 2), ARGS, tmp_path / "mask.pt2")
    got = compile_model(str(path), SPEC, SPEC, CompileOptions(mode="training"), "cpu", str(tmp_path / "a.pt2"))
    assert {c["fqn"] for c in weights_mod.describe(got["weights"])} == {"l.weight", "l.bias", "gain", "offset"}
    checked = check_training(str(path), got["package"], SPEC, "cpu", adversarial=False)
    assert checked["passed"] and len(checked["training"]["steps"]) == 3
    assert {r["role"] for r in checked["training"]["outputs"]} >= {"loss", "grad:gain", "grad:l.weight"}


class EmbedClassify(torch.nn.Module):
    """Token ids through an embedding, a linear head, cross-entropy against labels: both inputs are indices."""

    def __init__(self) -> None:
        super().__init__()
        self.e = torch.nn.Embedding(10, 8)
        self.head = torch.nn.Linear(8, 5)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(self.e(ids).mean(dim=1))
        return torch.nn.functional.cross_entropy(logits, labels), logits.detach()


@pytest.mark.slow
def test_with_negative_ids_moved_out_of_range_hostile_ids_and_labels_are_refused(tmp_path, monkeypatch):
    """The rewrite torch 2.11 gets (compiler.compat.INDUCTOR_WRAPS_NEGATIVE_IDS), forced on this torch: the upload's
    embedding and cross-entropy are compiled in their rewritten forms, and the adversarial probes' ids and labels at
    -1 and beyond the table are refused where eager refuses (on the H100 the package had returned at both)."""
    from compiler.pipeline import compile_model

    monkeypatch.setattr("compiler.bounds.INDUCTOR_WRAPS_NEGATIVE_IDS", True)
    ids, labels = torch.randint(0, 10, (6, 3)), torch.randint(0, 5, (6,))
    path = export_train(seeded(EmbedClassify, 4), (ids, labels), tmp_path / "embed.pt2")
    spec = [{"name": "ids", "dtype": "int64", "shape": [6, 3]}, {"name": "labels", "dtype": "int64", "shape": [6]}]
    got = compile_model(str(path), spec, spec, CompileOptions(mode="training"), "cpu", str(tmp_path / "a.pt2"))
    import json

    rewritten = json.loads(Path(got["report"]).read_text())["stages"]["capture"]["bounds"]["ops"]
    assert rewritten == {"aten.embedding.default": 1, "aten.cross_entropy_loss.default": 1}
    checked = check_training(str(path), got["package"], spec, "cpu")
    adversarial = checked["adversarial"]
    assert not adversarial["failures"] and adversarial["outcomes"].get("refused", 0) > 0, adversarial["outcomes"]
    assert {-1}.issubset(adversarial["inputs"]["ids"]) and {-1}.issubset(adversarial["inputs"]["labels"])


def test_the_reports_autograd_trace_runs_on_fake_tensors_and_gives_a_real_runs_graphs():
    """The report's AOTAutograd trace (forward, backward, the partition) runs nothing on the device and leaves the
    module as it was, and its graphs are those AOTAutograd traces on a real run."""
    from torch._functorch.aot_autograd import aot_module
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from compiler.compat.autograd import aot_joint_and_partition
    from compiler.compat.joint import training_decompositions

    class Step(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.bn, self.emb = torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Embedding(10, 8)
            self.register_buffer("shift", torch.linspace(0, 1, 8), persistent=False)

        def forward(self, x: torch.Tensor, i: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            scale = torch.tensor([1.0, 2.0] * 4)  # a constant export lifts: a real tensor in the backward graph
            return torch.nn.functional.cross_entropy(self.bn(self.lin(x) * scale + self.emb(i)) + self.shift, y)

    args = (torch.randn(4, 8), torch.randint(0, 10, (4,)), torch.randint(0, 8, (4,)))
    module = torch.export.export(Step().train(), args).module()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    fake, traced_on = aot_joint_and_partition(module, args, {})
    assert traced_on == "fake tensors"
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())  # BatchNorm's stats untouched

    real: dict[str, torch.fx.GraphModule] = {}

    def partition(joint: torch.fx.GraphModule, joint_inputs: Any, **kw: Any) -> Any:
        real["joint"] = joint
        real["forward"], real["backward"] = min_cut_rematerialization_partition(joint, joint_inputs, **kw)
        return real["forward"], real["backward"]

    def boxed(gm: torch.fx.GraphModule) -> Any:
        def run(a: list[Any]) -> Any:
            got = list(a)
            a.clear()
            return gm(*got)

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    compiled = aot_module(module, fw_compiler=lambda gm, ex: boxed(gm), bw_compiler=lambda gm, ex: boxed(gm),
                          partition_fn=partition, decompositions=training_decompositions())
    compiled(*args).backward()
    assert not all(torch.equal(v, before[k]) for k, v in module.state_dict().items())  # the real run did update them
    assert {k: g.code for k, g in fake.items()} == {k: g.code for k, g in real.items()}


def test_where_the_fake_trace_fails_the_report_traces_on_the_device_and_says_so(monkeypatch):
    from compiler.compat import autograd

    real_trace = autograd._trace

    def no_fake(module: Any, args: Any, kwargs: Any, fake: bool) -> Any:
        if fake:
            raise RuntimeError("no fake kernel for this op\nmore")
        return real_trace(module, args, kwargs, fake)

    args = (torch.randn(4, 8),)
    module = torch.export.export(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), args).module()
    monkeypatch.setattr(autograd, "_trace", no_fake)
    got, traced_on = autograd.aot_joint_and_partition(module, args, {})
    assert traced_on == "the inputs' device (fake tensors failed: RuntimeError: no fake kernel for this op)"
    assert set(got) == {"joint", "forward", "backward"}


@pytest.mark.slow
def test_a_program_whose_own_step_fails_at_its_sample_inputs_is_refused_naming_eager(tmp_path):
    """Ids sampled beyond the table (an upload whose labels run past its classes, as EVA02-Tiny's did: 1000-class
    labels against a head of 192 features): the check's inputs are drawn within the samples' range, eager's own
    step raises, and the check says so rather than passing the exception on bare (on CUDA a device-side assert)."""
    ids = torch.arange(6) * 3  # 0..15 against a table of 10 rows
    path = export_train(seeded(TrainLookup, 1), (ids, torch.randn(6, 4)), tmp_path / "past.pt2")
    spec = [{"name": "ids", "dtype": "int64", "shape": [6]}, {"name": "y", "dtype": "float32", "shape": [6, 4]}]
    configs = {**(weightless_configs() or {}), **TRAINING_INDUCTOR_CONFIGS}
    configs["aot_inductor.metadata"] = {**configs.get("aot_inductor.metadata", {}), TRAIN_METADATA: "0"}
    package = _broken_build({"dir": tmp_path, "path": path}, "past-package.pt2", configs)
    with pytest.raises(CheckFailed, match=r"^training check, step 1 of 3: the uploaded program's own forward and "
                                          r"backward \(eager on cpu\) raised on the check's inputs, drawn as its "
                                          r"samples are .*: IndexError: index 1\d is out of bounds"):
        check_training(str(path), package, spec, "cpu", adversarial=False)
    # DeBERTa-v3's own step under bf16 autocast overflows (masked_fill with float32's min): the dtype is named
    with pytest.raises(CheckFailed, match=r"\(eager on cpu, under bfloat16 autocast\) raised"):
        check_training(str(path), package, spec, "cpu", adversarial=False, precision="bf16")


def test_a_report_trace_that_fails_is_said_in_the_report_and_the_job_goes_on(mlp, monkeypatch):
    """The report's AOTAutograd trace is the report's only: where it fails (DeBERTa-v3's bf16 overflow on an H200),
    the autograd stage records why and returns, and the report's renderings say it, rather than refusing a model
    whose package was never built."""
    from client.render import report_notes
    from compiler import report as rep
    from compiler import stages

    def overflow(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("value cannot be converted to type c10::BFloat16 without overflow")

    monkeypatch.setattr(stages, "aot_joint_and_partition", overflow)
    captured = stages.capture(mlp["ep"], SPEC, SPEC, "cpu", "keep", training=True)
    got = stages.autograd(captured, training=True)
    assert got.program is not None and got.facts["training"]["unavailable"] == (
        "tracing forward and backward for the report failed: RuntimeError: value cannot be converted to type "
        "c10::BFloat16 without overflow")
    assert "graphs/joint.py" not in got.graphs
    report = {"stages": {"capture": captured.facts, "autograd": got.facts}}
    row = next(r for r in rep.summary_rows(report) if r["stage"] == "autograd")
    assert row["detail"].endswith("; the joint graph's trace failed (its facts say why)")
    assert ("training: tracing forward and backward for the report failed: RuntimeError: value cannot be converted "
            "to type c10::BFloat16 without overflow") in report_notes("k", report)
