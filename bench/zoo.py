"""The benchmark's models: real architectures with random weights, built from what the GPU machine has
(torchvision, timm, transformers). Each entry gives a bf16 CUDA module, example inputs at any batch, and the batch
a server would run it at (vision 32 at 224², encoders 16x128, decoders and BERT-large 8x256 or 8x128)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
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


def _images(batch: int, size: int = 224, device: str = "cuda") -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch, 3, size, size, dtype=DTYPE, device=device),)


def _tokens(batch: int, seq: int, vocab: int, device: str = "cuda") -> tuple[torch.Tensor, ...]:
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    return ids, torch.ones(batch, seq, dtype=torch.int64, device=device)


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

        configs: dict[str, Callable[[], torch.nn.Module]] = {
            "bert": lambda: t.BertModel(t.BertConfig()),
            "roberta": lambda: t.RobertaModel(t.RobertaConfig(vocab_size=50265, max_position_embeddings=514,
                                                              type_vocab_size=1)),
            "distilbert": lambda: t.DistilBertModel(t.DistilBertConfig()),
            "gpt2": lambda: t.GPT2Model(t.GPT2Config(use_cache=False)),
            "t5enc": lambda: t.T5EncoderModel(t.T5Config(d_model=512, d_ff=2048, num_layers=6, num_heads=8,
                                                         vocab_size=32128)),
            "llama": lambda: t.LlamaModel(t.LlamaConfig(hidden_size=1024, intermediate_size=2816,
                                                        num_hidden_layers=8, num_attention_heads=16,
                                                        num_key_value_heads=8, vocab_size=32000,
                                                        max_position_embeddings=2048, use_cache=False)),
            "albert": lambda: t.AlbertModel(t.AlbertConfig(embedding_size=128, hidden_size=768, num_hidden_layers=12,
                                                           num_attention_heads=12, intermediate_size=3072)),
            "electra": lambda: t.ElectraModel(t.ElectraConfig()),  # the small discriminator
            "mobilebert": lambda: t.MobileBertModel(t.MobileBertConfig()),
            "bert_large": lambda: t.BertModel(t.BertConfig(hidden_size=1024, num_hidden_layers=24,
                                                           num_attention_heads=16, intermediate_size=4096)),
            "opt": lambda: t.OPTModel(t.OPTConfig(hidden_size=768, num_hidden_layers=12, ffn_dim=3072,
                                                  num_attention_heads=12, use_cache=False)),
            "qwen2": lambda: t.Qwen2Model(t.Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=8,
                                                        num_attention_heads=14, num_key_value_heads=2,
                                                        vocab_size=32000, use_cache=False)),
            "mpnet": lambda: t.MPNetModel(t.MPNetConfig()),
        }
        if kind not in configs:
            raise KeyError(kind)
        return FirstOutput(configs[kind]())
    return build


@dataclass(frozen=True)
class Entry:
    builder: Callable[[], torch.nn.Module]
    inputs: Callable[[int, str], tuple[Any, ...]]  # the example inputs at a batch size, on a device
    family: str
    batch: int  # the serving batch: what a server batches requests up to for this kind of model


def _vision(builder: Callable[[], torch.nn.Module], family: str, batch: int = 32, size: int = 224) -> Entry:
    return Entry(builder, lambda b, device: _images(b, size, device), family, batch)


def _text(kind: str, seq: int, vocab: int, batch: int = 16) -> Entry:
    return Entry(_hf(kind), lambda b, device: _tokens(b, seq, vocab, device), "transformers", batch)


# The first 17 are the 2026-11-22 benchmark's (same architectures, inputs and batch); the rest came with issue 13.
MODELS: dict[str, Entry] = {
    "resnet50": _vision(_tv("resnet50"), "torchvision"),
    "mobilenet_v3_large": _vision(_tv("mobilenet_v3_large"), "torchvision"),
    "efficientnet_b0": _vision(_tv("efficientnet_b0"), "torchvision"),
    "densenet121": _vision(_tv("densenet121"), "torchvision"),
    "convnext_tiny": _vision(_tv("convnext_tiny"), "torchvision"),
    "vit_b_16": _vision(_tv("vit_b_16"), "torchvision"),
    "timm_vit_small_patch16_224": _vision(_timm("vit_small_patch16_224"), "timm"),
    "timm_convnext_small": _vision(_timm("convnext_small"), "timm"),
    "timm_swin_tiny": _vision(_timm("swin_tiny_patch4_window7_224"), "timm"),
    "timm_mixer_b16_224": _vision(_timm("mixer_b16_224"), "timm"),
    "timm_resnext50_32x4d": _vision(_timm("resnext50_32x4d"), "timm"),
    "hf_bert_base": _text("bert", 128, 30522),
    "hf_roberta_base": _text("roberta", 128, 50265),
    "hf_distilbert": _text("distilbert", 128, 30522),
    "hf_gpt2": _text("gpt2", 256, 50257, batch=8),
    "hf_t5_encoder": _text("t5enc", 128, 32128),
    "hf_llama_small": _text("llama", 256, 32000, batch=8),
    # torchvision
    "resnet18": _vision(_tv("resnet18"), "torchvision"),
    "mobilenet_v2": _vision(_tv("mobilenet_v2"), "torchvision"),
    "shufflenet_v2_x1_0": _vision(_tv("shufflenet_v2_x1_0"), "torchvision"),
    "regnet_y_1_6gf": _vision(_tv("regnet_y_1_6gf"), "torchvision"),
    "swin_t": _vision(_tv("swin_t"), "torchvision"),
    "mnasnet1_0": _vision(_tv("mnasnet1_0"), "torchvision"),
    # timm
    "timm_regnety_016": _vision(_timm("regnety_016"), "timm"),
    "timm_ghostnet_100": _vision(_timm("ghostnet_100"), "timm"),
    "timm_deit_tiny_patch16_224": _vision(_timm("deit_tiny_patch16_224"), "timm"),
    "timm_efficientnet_b2": _vision(_timm("efficientnet_b2"), "timm", size=256),
    "timm_repvgg_a2": _vision(_timm("repvgg_a2"), "timm"),
    "timm_levit_128": _vision(_timm("levit_128"), "timm"),
    # transformers
    "hf_albert_base": _text("albert", 128, 30000),
    "hf_electra_small": _text("electra", 128, 30522),
    "hf_mobilebert": _text("mobilebert", 128, 30522),
    "hf_bert_large": _text("bert_large", 128, 30522, batch=8),
    "hf_opt_125m": _text("opt", 256, 50272, batch=8),
    "hf_qwen2_small": _text("qwen2", 256, 32000, batch=8),
    "hf_mpnet_base": _text("mpnet", 128, 30527),
}


def inputs(name: str, batch: int | None = None, device: str = "cuda") -> tuple[Any, ...]:
    """The model's example inputs at `batch` (default: its serving batch)."""
    entry = MODELS[name]
    return tuple(entry.inputs(entry.batch if batch is None else batch, device))


def build(name: str, seed: int = 0, batch_mult: int = 1, device: str = "cuda",
          batch: int | None = None) -> tuple[torch.nn.Module, tuple[Any, ...]]:
    """The model with weights drawn from `seed` (another seed: same architecture, new weights, as a new
    checkpoint of it would be), and inputs at `batch` (default: `batch_mult` times its serving batch)."""
    entry = MODELS[name]
    torch.manual_seed(seed)
    model = entry.builder().eval()
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
    return model, inputs(name, entry.batch * batch_mult if batch is None else batch, device)
