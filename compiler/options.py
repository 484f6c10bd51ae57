"""Compile options: one frozen, typed model, turned into Inductor's config dict in exactly one place.

This module imports no torch, so the API can validate options and hash them into cache keys. Every option is part
of the cache key (with its default spelled out). Inductor settings beyond `mode` are reachable only through the
small allow-list in `InductorSettings`: a user never passes config strings through to torch.

Some Inductor settings are not options: `FORCED_INDUCTOR_CONFIGS` is set in every compile, whatever was asked, and
is a factor of every cache key (compiler.cachekey), so an artifact built without them is never served as one built
with them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, model_validator
from pydantic_core import PydanticCustomError

from compiler.targets import IsaPin

Mode = Literal["default", "max-autotune", "training"]
Precision = Literal["keep", "bf16", "fp16"]
Convolutions = Literal["library", "generated"]


def _json_integer(value: Any) -> Any:
    """An integer as JSON Schema has it: 8 or 8.0, never true or "8" (which pydantic's lax ints take)."""
    if isinstance(value, (bool, str, bytes)):
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return int(value) if isinstance(value, float) and value.is_integer() else value


# Annotated[int, Field(bounds...), JSON_INT]: after the bounds, which pydantic then still publishes as JSON Schema's
# minimum and maximum (before them, it cannot, and writes "ge" and "le").
JSON_INT = BeforeValidator(_json_integer)
GemmBackends = Literal["ATEN", "TRITON", "ATEN,TRITON", "CPP", "ATEN,CPP", "ATEN,TRITON,CPP"]


class InductorSettings(BaseModel):
    """The Inductor settings a request may change. Unset (null) leaves torch's default in place.

    Each entry names a `torch._inductor.config` attribute that exists in every torch this service supports; the
    values are typed and bounded, so no request can reach code execution, file paths or debug dumps through here.
    """

    # JSON's own bools and ints (StrictBool, JSON_INT): a request's 1 or "true" is no bool, as the schema says.
    model_config = ConfigDict(frozen=True, extra="forbid")

    coordinate_descent_tuning: StrictBool | None = Field(
        default=None, description="After autotuning, search neighbouring Triton configs (slower compile)."
    )
    epilogue_fusion: StrictBool | None = Field(default=None, description="Fuse pointwise ops into matmul epilogues.")
    shape_padding: StrictBool | None = Field(default=None, description="Pad matmul shapes to aligned sizes.")
    aggressive_fusion: StrictBool | None = Field(default=None, description="Fuse even without shared memory reads.")
    max_fusion_size: Annotated[int, Field(ge=1, le=256), JSON_INT] | None = Field(
        default=None, description="Most nodes in one fused kernel.")
    split_reductions: StrictBool | None = Field(default=None, description="Split large reductions across kernels.")
    max_autotune_gemm_backends: GemmBackends | None = Field(
        default=None, description="Matmul backends max-autotune chooses among."
    )
    layout_optimization: StrictBool | None = Field(default=None, description=(
        "Let Inductor turn convolutions channels-last (its default). false keeps them NCHW: on an H100, cuDNN's "
        "first call of a package with depthwise convolutions drops from 2.8 to 0.3 s (MobileNetV3), at 3-20 % "
        "slower steady calls (bench/first_call.py)."))

    def configs(self) -> dict[str, Any]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


# Set in every compile (docs/security.md, "No compiled memory access without a bound"). Inductor bounds-checks an
# indirect index only where a lowering asks for it (`check=True`); `_unsafe_index`, `_unsafe_index_put`,
# `_unsafe_masked_index` and decompositions such as max_unpool2d's and masked_scatter's ask for none, so an
# out-of-range index reads or writes memory the kernel does not own. `debug_index_asserts` makes every indirect
# index assert its bounds (torch/_inductor/utils.py `generate_assert`: `(check or debug_index_asserts) and
# assert_indirect_indexing`); range analysis still drops the asserts it proves unnecessary (an upsample's computed
# indices). `assert_indirect_indexing` also compiles Triton kernels with `debug`, which is what makes
# `tl.device_assert` fire. Both names and their meaning are the same in torch 2.11 and 2.13.
FORCED_INDUCTOR_CONFIGS: dict[str, Any] = {"assert_indirect_indexing": True, "debug_index_asserts": True}
# Bump when what compiler.bounds rewrites or refuses, or how compiler.compat.shims patches codegen, changes: it is a
# cache-key factor, so artifacts built under the old rules are compiled again rather than served. 4 (2026-11-30): the
# review of index ops (new refusals, select's and segment_reduce's rewrites, embedding_bag's offsets, on CUDA too)
# and the check's float and mask cases; 484940f changed the rewrites without the bump, so a cached artifact built
# before it was still served. tests/compiler/test_options.py pins it with a fingerprint of these rules.
BOUNDS_REVISION = 4

# How a package holds its weights (a cache-key factor: compiler.cachekey `weights`). "external": built without them
# (aot_inductor.package_constants_in_so=False and always_keep_tensor_constants=True, which change the generated code)
# and bound at load from the model's one weights blob (compiler/weights.py). "embedded": inside the package, as
# before; what freezing gives, since frozen weights are folded into constants of the package's own that no blob of
# the program's FQNs could feed. Bump WEIGHTS_REVISION when how weightless packages are built changes.
# 2: 0-d lifted constants inlined as ops, out of the blob; 3: weights that only dead code reads (an HF encoder's
# pooler when the hidden states alone are returned) out of the blob too.
WEIGHTS_REVISION = 3


def weights_layout(options: dict[str, Any]) -> str:
    """"external" or "embedded" for canonical options (what a job carries). max-autotune embeds too: on a CPU its
    GEMM templates pack weights into constants of the package's own at build time, which no blob feeds (the bind
    failed in update_user_managed_constant_buffer), and a key's layout cannot depend on the target's kind."""
    if options.get("freezing") or options.get("embed_weights") or options.get("mode") == "max-autotune":
        return "embedded"
    return "external"


# Options newer than the cache key's format 2: spelled out in the canonical form (and so in the key) only when set.
ADDED_AFTER_FORMAT_2 = ("allow_nonfinite", "embed_weights", "loss_output", "convolutions", "autotune")
INDUCTOR_ADDED_AFTER_FORMAT_2 = ("layout_optimization",)

# Set in every mode=training compile (compiler/training.py), and a factor of its key (compiler.cachekey).
# - joint_graph_constant_folding off: Inductor's joint-graph pass `constant_fold_uniform_value` folds a buffer of
#   uniform value into a literal even with always_keep_tensor_constants: BatchNorm's 0-d `num_batches_tracked`
#   became `= 1` on every step (seen on torch 2.13), frozen while eager counts on.
# - fallback_random on: the step's random ops (the joint graph keeps dropout as aten.native_dropout) call ATen's own
#   kernels on torch's generator instead of Inductor's Philox seeds, so a step draws what eager draws after the same
#   torch.manual_seed: dropout masks, and so losses and gradients, match eager's exactly (seen on torch 2.13), the
#   check can compare a step that drops, and a caller's seed governs the package as it governs eager.
TRAINING_INDUCTOR_CONFIGS: dict[str, Any] = {"joint_graph_constant_folding": False, "fallback_random": True}
# A tuned train step (mode=training, autotune) chooses its matmuls among these. Inductor's CPP GEMM templates pack a
# weight into a constant of the package's own at build time (why max-autotune embeds weights, `weights_layout`):
# in a train step that is a parameter frozen at its first value while the optimizer updates the caller's.
TRAINING_GEMM_BACKENDS = "ATEN,TRITON"
# Most outputs an upload may have, so that `loss_output` is bounded before the program is read.
MAX_LOSS_OUTPUT = 4095


class CompileOptions(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Mode = Field(
        default="default",
        description="default; max-autotune (slower compile, faster kernels); training (a train-step package: one "
        "call runs forward and backward and returns the loss, the other outputs and a gradient per parameter; "
        "docs/training.md).",
    )
    loss_output: Annotated[int, Field(ge=0, le=MAX_LOSS_OUTPUT), JSON_INT] = Field(
        default=0, description="mode=training: which of the program's outputs is the loss (a floating scalar). The "
        "other outputs must not need a gradient (return them detached).")
    precision: Precision = Field(
        default="keep",
        description="keep the program's dtypes, or compute in bf16/fp16. For inference, weights are cast, and "
        "floating inputs and outputs are cast at the edges, so the artifact takes and returns the same dtypes. For "
        "mode=training it is mixed precision: the step runs under torch.autocast to that dtype, the weights and "
        "gradients keep theirs.",
    )
    freezing: StrictBool = Field(default=False, description=(
        "Fold weights into the graph as constants (inference). A frozen package carries its own weights: it is "
        "self-contained and shares no weights blob with the model's other artifacts."))
    inductor: InductorSettings = Field(default_factory=InductorSettings)
    prims_view: StrictBool = Field(default=False,
                                   description="Also record the graph decomposed to prims in the report.")
    allow_nonfinite: StrictBool = Field(
        default=False,
        description="Publish an artifact whose outputs hold NaN or inf at the check's inputs (the compiled and the "
        "eager results must still agree, non-finite values in the same places). Off: any NaN or inf fails the check.",
    )

    convolutions: Convolutions = Field(default="library", description=(
        "library: convolutions call cuDNN (oneDNN on a CPU). generated: depthwise convolutions become generated "
        "kernels (on a GPU one Triton kernel each, compiled into the package; on a CPU fused pointwise ops) and 1x1 "
        "convolutions matmuls, so the package builds no cuDNN plan for them on its first call: on an H200 the "
        "first call of EfficientNet-B0 and MobileNetV3-L went from 2.5-5.1 s to 0.21-0.32 s, and their steady "
        "calls were 0.97x and 0.93x the library's (bench/first_call.py, 2026-12-01, medians of 2 rounds). "
        "Inference only; other convolutions stay the library's."))
    autotune: StrictBool = Field(default=False, description=(
        "mode=training: tune the train step's kernels as mode=max-autotune tunes an inference package's: the "
        "forward's and the backward's matmuls benchmarked on the worker's device at build time (a slower compile, "
        "paid once instead of on every rank). The matmuls choose among ATen and Triton only (Inductor's CPU GEMM "
        "templates would pack a parameter into a constant, frozen while the optimizer updates it). For inference, "
        "mode=max-autotune."))
    embed_weights: StrictBool = Field(default=False, description=(
        "Build the package with its weights inside it (self-contained), for tools that cannot bind a weights blob: "
        "torch's own aoti_load_package runs it as it is. Off: the package binds the model's one weights blob at "
        "load. `POST /v1/artifacts/{key}/self-contained` asks for this build of an artifact."))

    @model_validator(mode="after")
    def _inference_only_options(self) -> CompileOptions:
        if self.mode == "training" and (self.freezing or self.embed_weights):
            raise ValueError("freezing and embed_weights are for inference; a train step binds the caller's weights")
        if self.mode == "training" and self.convolutions != "library":
            raise ValueError("convolutions=generated is for inference packages; a train step keeps the library's")
        if self.mode != "training" and self.loss_output != 0:
            raise ValueError("loss_output names the loss of a training step: it needs mode=training")
        if self.autotune and self.mode != "training":
            raise ValueError("autotune tunes a train step (mode=training); an inference package asks "
                             "mode=max-autotune")
        if self.autotune and "CPP" in (self.inductor.max_autotune_gemm_backends or ""):
            raise ValueError("a tuned train step's matmuls choose among ATEN and TRITON: CPP's GEMM templates pack "
                             "weights into constants of the package, which would freeze parameters the step updates")
        return self

    def canonical(self) -> dict[str, Any]:
        """Every option with its value, defaults included, so equal options hash equal. Options added after cache
        key format 2 (`ADDED_AFTER_FORMAT_2`) appear only when set away from their default: a request that does
        not use them keeps the key it had before they existed."""
        d = self.model_dump(mode="json")
        for name in ADDED_AFTER_FORMAT_2:
            if d[name] == type(self).model_fields[name].default:
                del d[name]
        for name in INDUCTOR_ADDED_AFTER_FORMAT_2:
            if d["inductor"][name] is None:
                del d["inductor"][name]
        return d

    @property
    def training(self) -> bool:
        return self.mode == "training"

    @property
    def weightless(self) -> bool:
        """Whether the package is built without its weights (compiler/weights.py)."""
        return weights_layout(self.canonical()) == "external"

    def inductor_configs(self, pin: IsaPin | None = None) -> dict[str, Any]:
        """The `inductor_configs` passed to aoti_compile_and_package. Global torch config is never touched. The
        forced settings come last: no option can turn them off. `pin`, for a CPU target that names an x86-64
        level, adds the level's `-march` (`cpp.march`) and vector width (`cpp.simdlen`); compiler.compat.isa holds
        Inductor to them (and spells `-march` another way where a torch lacks `cpp.march`)."""
        configs: dict[str, Any] = {}
        if pin is not None:
            configs["cpp.march"] = pin.march
            if pin.simdlen is not None:
                configs["cpp.simdlen"] = pin.simdlen
        if self.mode == "max-autotune":
            configs["max_autotune"] = True
        if self.mode == "training":
            configs.update(TRAINING_INDUCTOR_CONFIGS)
            if self.autotune:  # inductor.max_autotune_gemm_backends below may narrow it (CPP is refused)
                configs.update(max_autotune=True, max_autotune_gemm_backends=TRAINING_GEMM_BACKENDS)
        if self.freezing:
            configs["freezing"] = True
        if self.convolutions == "generated":  # with compiler.convs' depthwise lowering, in the capture stage
            configs["conv_1x1_as_mm"] = True
        configs.update(self.inductor.configs())
        configs.update(FORCED_INDUCTOR_CONFIGS)
        return configs
