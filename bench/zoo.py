"""The benchmark's models: real architectures with random weights, built from what the GPU machine has
(torchvision, timm, transformers). Each entry gives a bf16 CUDA module and example inputs at a realistic batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

DTYPE = torch.bfloat16


class FirstOutput(torch.nn.Module):
    """HF models return ModelOutput objects; serving wants the hidden states as one tensor."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=False)[0]


def _images(batch: int, size: int = 224) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch, 3, size, size, dtype=DTYPE, device="cuda"),)


def _tokens(batch: int, seq: int, vocab: int) -> tuple[torch.Tensor, ...]:
    ids = torch.randint(0, vocab, (batch, seq), device="cuda")
    return ids, torch.ones(batch, seq, dtype=torch.int64, device="cuda")


def _tv(name: str) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        import torchvision

        return torchvision.models.get_model(name, weights=None)
    return build


def _timm(name: str) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        import timm

        return timm.create_model(name, pretrained=False)
    return build


def _hf(kind: str) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        import transformers as t

        if kind == "bert":
            m = t.BertModel(t.BertConfig())
        elif kind == "roberta":
            m = t.RobertaModel(t.RobertaConfig(vocab_size=50265, max_position_embeddings=514, type_vocab_size=1))
        elif kind == "distilbert":
            m = t.DistilBertModel(t.DistilBertConfig())
        elif kind == "gpt2":
            m = t.GPT2Model(t.GPT2Config(use_cache=False))
        elif kind == "t5enc":
            m = t.T5EncoderModel(t.T5Config(d_model=512, d_ff=2048, num_layers=6, num_heads=8, vocab_size=32128))
        elif kind == "llama":
            m = t.LlamaModel(t.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                           num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                                           max_position_embeddings=2048, use_cache=False))
        else:
            raise KeyError(kind)
        return FirstOutput(m)
    return build


# name -> (builder, inputs(batch multiplier) at the benchmark's batch times the multiplier, family)
MODELS: dict[str, tuple[Callable[[], torch.nn.Module], Callable[..., tuple[Any, ...]], str]] = {
    "resnet50": (_tv("resnet50"), lambda k=1: _images(32 * k), "torchvision"),
    "mobilenet_v3_large": (_tv("mobilenet_v3_large"), lambda k=1: _images(32 * k), "torchvision"),
    "efficientnet_b0": (_tv("efficientnet_b0"), lambda k=1: _images(32 * k), "torchvision"),
    "densenet121": (_tv("densenet121"), lambda k=1: _images(32 * k), "torchvision"),
    "convnext_tiny": (_tv("convnext_tiny"), lambda k=1: _images(32 * k), "torchvision"),
    "vit_b_16": (_tv("vit_b_16"), lambda k=1: _images(32 * k), "torchvision"),
    "timm_vit_small_patch16_224": (_timm("vit_small_patch16_224"), lambda k=1: _images(32 * k), "timm"),
    "timm_convnext_small": (_timm("convnext_small"), lambda k=1: _images(32 * k), "timm"),
    "timm_swin_tiny": (_timm("swin_tiny_patch4_window7_224"), lambda k=1: _images(32 * k), "timm"),
    "timm_mixer_b16_224": (_timm("mixer_b16_224"), lambda k=1: _images(32 * k), "timm"),
    "timm_resnext50_32x4d": (_timm("resnext50_32x4d"), lambda k=1: _images(32 * k), "timm"),
    "hf_bert_base": (_hf("bert"), lambda k=1: _tokens(16 * k, 128, 30522), "transformers"),
    "hf_roberta_base": (_hf("roberta"), lambda k=1: _tokens(16 * k, 128, 50265), "transformers"),
    "hf_distilbert": (_hf("distilbert"), lambda k=1: _tokens(16 * k, 128, 30522), "transformers"),
    "hf_gpt2": (_hf("gpt2"), lambda k=1: _tokens(8 * k, 256, 50257), "transformers"),
    "hf_t5_encoder": (_hf("t5enc"), lambda k=1: _tokens(16 * k, 128, 32128), "transformers"),
    "hf_llama_small": (_hf("llama"), lambda k=1: _tokens(8 * k, 256, 32000), "transformers"),
}


def build(name: str, seed: int = 0, batch_mult: int = 1,
          device: str = "cuda") -> tuple[torch.nn.Module, tuple[Any, ...]]:
    """The model with weights drawn from `seed` (another seed: same architecture, new weights, as a new
    checkpoint of it would be), and inputs at `batch_mult` times the benchmark's batch."""
    builder, inputs, _ = MODELS[name]
    torch.manual_seed(seed)
    model = builder().eval()
    # Some libraries start weights at zero: classifier heads (torchvision's ViT, timm's MLP-Mixer) answer zeros
    # whatever the input, and zeroed last-norm scales in residual blocks (timm's ResNets, zero_init_last) make
    # whole branches add nothing, so comparing an artifact with eager would compare very little. Such weights
    # get the values a trained checkpoint's would be near: small random matrices, norm scales of one.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.is_floating_point() and p.numel() and not p.any():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.02)
                elif pname.endswith("weight"):
                    p.fill_(1.0)
    model = model.to(device=device, dtype=DTYPE)
    return model, tuple(t.to(device) for t in inputs(batch_mult))
