"""The models bench/train.py trains: tiny ones for a CPU run, or bench/zoo.py's with a loss attached (`kind_of`: a
classifier's cross-entropy, a text model's head, or the mean square of what any other body outputs). Each module
returns (loss, its output detached), fp32 weights, in training mode. Imported after `import torch` is timed."""

from __future__ import annotations

import copy
from typing import Any

import torch

from tests.modelzoo import TrainMLP

TINY = ("train_mlp", "conv_bn", "mlp_deep")


class Classify(torch.nn.Module):
    """Cross-entropy of the body's logits against labels. A body that trains with auxiliary heads (torchvision's
    Inception-v3 and GoogLeNet return a named tuple in training mode: the logits, then the aux logits) adds each
    aux head's loss at AUX_WEIGHT, as torchvision's reference training script does for Inception-v3."""

    AUX_WEIGHT = 0.4

    def __init__(self, body: torch.nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.body(x)
        logits, *aux = out if isinstance(out, tuple) else (out,)
        loss = torch.nn.functional.cross_entropy(logits.float(), labels)
        for a in aux:
            if isinstance(a, torch.Tensor):
                loss = loss + self.AUX_WEIGHT * torch.nn.functional.cross_entropy(a.float(), labels)
        return loss, logits.detach()


class TextClassify(torch.nn.Module):
    """A linear head over the mean hidden state of a text encoder/decoder, cross-entropy against labels."""

    def __init__(self, body: torch.nn.Module, hidden: int) -> None:
        super().__init__()
        self.body = body
        self.head = torch.nn.Linear(hidden, 10)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor,
                labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(self.body(ids, mask).float().mean(dim=1))
        return torch.nn.functional.cross_entropy(logits, labels), logits.detach()


class MeanSquare(torch.nn.Module):
    """The zoo's other bodies (dense prediction, detection backbones, HF vision and speech towers): the mean square of
    every output tensor as the loss, a regression to zero of all they compute, so that each output takes a part in
    the backward; the first output, detached, beside it."""

    def __init__(self, body: torch.nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.body(*inputs)
        outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
        loss = sum((t.float().pow(2).mean() for t in outs), torch.zeros((), device=outs[0].device))
        return loss, outs[0].detach()


def kind_of(name: str, entry: Any, inputs: tuple[torch.Tensor, ...], body: torch.nn.Module | None = None) -> str:
    """`classify` (a torchvision or timm classifier: logits, cross-entropy over its classes), `text` (token ids and
    a mask: a linear head over the mean hidden state) or `regress` (MeanSquare). A timm body built without a
    classifier head (`num_classes` 0: EVA02-Tiny, a masked-image-modelling checkpoint, returns its 192 features)
    regresses: labels over 1000 classes against 192 features are out of range, which eager refuses on a CPU and
    asserts on in a CUDA kernel (that was EVA02's "device-side assert" on an H200)."""
    if len(inputs) == 2 and not any(t.is_floating_point() for t in inputs):
        return "text"
    dense = any(k in name for k in ("fcn_", "deeplab", "lraspp", "_backbone"))
    headless = body is not None and getattr(body, "num_classes", None) == 0
    return "classify" if entry.family in ("torchvision", "timm") and not dense and not headless else "regress"


def classes(body: torch.nn.Module) -> int:
    """How many classes a classifier's labels range over: its `num_classes` (timm), at most 1000; torchvision's 1000."""
    return min(int(getattr(body, "num_classes", 1000) or 1000), 1000)


def hidden_size(model: Any) -> int:
    cfg = getattr(getattr(model, "model", model), "config", None)
    return int(getattr(cfg, "hidden_size", None) or getattr(cfg, "d_model", None) or getattr(cfg, "dim", None)
               or getattr(cfg, "n_embd", 768))


def no_dropout(model: torch.nn.Module) -> None:
    """Dropout (and stochastic depth) at p=0, so that step times compare the same arithmetic (a train-step package
    draws with ATen's kernels on torch's generator, options.TRAINING_INDUCTOR_CONFIGS, where torch.compile fuses the
    mask into its Triton kernels). Modules' Dropout p, and float attributes named for dropout that models pass
    to attention kernels (HF's `dropout_prob`, `attention_dropout`), on the module and on an HF model's `config`.

    The config matters for LayerDrop: wav2vec2 and HuBERT read `config.layerdrop`, and while it is above 0 their
    encoders branch on `torch.rand([]) < layerdrop`, which no export can trace (GuardOnDataDependentSymNode, the
    coverage runs' refusal of both). SpecAugment (`apply_spec_augment`) is turned off for the same reason: its
    masks are drawn with numpy, so an export would bake one draw into the program as a constant."""
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) or type(m).__name__ == "StochasticDepth":
            m.p = 0.0  # torchvision's StochasticDepth (EfficientNet, ConvNeXt) draws with bernoulli_ at p
        config = getattr(m, "config", None)
        for owner in (m, config) if config is not None and hasattr(config, "__dict__") else (m,):
            for attr, value in list(vars(owner).items()):
                if "drop" in attr and isinstance(value, float):
                    setattr(owner, attr, 0.0)
        if getattr(config, "apply_spec_augment", False):
            config.apply_spec_augment = False


def build(name: str, batch: int | None, device: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    m: torch.nn.Module
    if name == "train_mlp":
        b = batch or 64
        m = TrainMLP(64, 256, 16)
        args: tuple[torch.Tensor, ...] = (torch.randn(b, 64, generator=gen), torch.randn(b, 16, generator=gen))
    elif name == "conv_bn":
        b = batch or 16
        m = Classify(torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10)))
        args = (torch.randn(b, 3, 32, 32, generator=gen), torch.randint(0, 10, (b,), generator=gen))
    elif name == "mlp_deep":
        b = batch or 16
        m = Classify(torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU())
                                           for _ in range(4)], torch.nn.Linear(512, 10)))
        args = (torch.randn(b, 512, generator=gen), torch.randint(0, 10, (b,), generator=gen))
    else:
        from bench import zoo

        entry = zoo.MODELS[name]
        body, inputs = zoo.build(name, device="cpu", batch=batch)
        body = body.float()
        inputs = tuple(t.float() if t.is_floating_point() else t for t in inputs)
        b = int(inputs[0].shape[0])
        no_dropout(body)
        kind = kind_of(name, entry, inputs, body)
        if kind == "regress":
            m, args = MeanSquare(body), inputs
        else:
            text = kind == "text"
            m = TextClassify(body, hidden_size(body)) if text else Classify(body)
            args = (*inputs, torch.randint(0, 10 if text else classes(body), (b,), generator=gen))
    return m.to(device).train(), tuple(t.to(device) for t in args)


def exported(name: str, batch: int | None, device: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...],
                                                                  torch.export.ExportedProgram, list[dict[str, Any]]]:
    """`build`'s model and inputs, the train program exported from a copy of the model, and its input spec (name,
    dtype, shape per user input), as an upload would declare it."""
    from bench.zoo import spec_of

    model, args = build(name, batch, device)
    ep = torch.export.export(copy.deepcopy(model), args)
    return model, args, ep, spec_of(ep, args)
