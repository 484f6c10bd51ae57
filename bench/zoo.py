"""The benchmark's models: real architectures with random weights, built offline from configs with what the GPU
machine has (torchvision, timm, transformers). Each entry gives a bf16 module, example inputs at any batch on any
device, and the batch a server would run it at (vision 32 at 224², encoders 16x128, decoders and BERT-large 8x256 or
8x128, dense prediction 8 at 512² to 640², audio 8 clips).

Kinds: classifiers, vision transformers, segmentation models, detectors' backbone + FPN, text encoders, decoders
(hidden states, no generate), speech encoders and CLIP's towers. A decoder's config is its real one unless its
comment says it is scaled down."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

DTYPE = torch.bfloat16


def spec_of(ep: torch.export.ExportedProgram, args: tuple[torch.Tensor, ...]) -> list[dict[str, Any]]:
    """The input spec (name, dtype, shape per user input) of a program exported from `args`, as an upload would
    declare it."""
    names = [s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    return [{"name": n, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
            for n, t in zip(names, args, strict=True)]


class FirstOutput(torch.nn.Module):
    """HF models return ModelOutput objects; serving wants the hidden states as one tensor."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=False)[0]


class Pixels(torch.nn.Module):
    """An HF vision model's first output (hidden states or logits) from `pixel_values`."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values, return_dict=False)[0]


class Waveform(torch.nn.Module):
    """An HF speech encoder's hidden states from raw 16 kHz audio (`input_values`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_values: torch.Tensor) -> torch.Tensor:
        return self.model(input_values=input_values, return_dict=False)[0]


class MelFeatures(torch.nn.Module):
    """Whisper's encoder: hidden states from log-mel features (`input_features`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_features: torch.Tensor) -> torch.Tensor:
        return self.model(input_features=input_features, return_dict=False)[0]


class Maps(torch.nn.Module):
    """torchvision's dense models return a dict of maps (FPN levels, a segmentation's 'out'): serving wants
    tensors, in the dict's order."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.model(x).values())


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


def _tv_segmentation(name: str) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        import torchvision

        # weights_backbone=None: the default would download ImageNet weights for the backbone.
        return Maps(torchvision.models.get_model(name, weights=None, weights_backbone=None, aux_loss=False))
    return build


def _tv_detection_backbone(name: str) -> Callable[[], torch.nn.Module]:
    """The backbone and FPN of a torchvision detector: what runs on every image. The heads' box decoding and NMS
    (data-dependent shapes, a C++ op) are left to the server."""
    def build() -> torch.nn.Module:
        import torchvision

        return Maps(torchvision.models.get_model(name, weights=None, weights_backbone=None).backbone)
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
            # issue 24: the wider corpus
            "deberta_v3_small": lambda: t.DebertaV2Model(t.DebertaV2Config(
                vocab_size=128100, hidden_size=768, num_hidden_layers=6, num_attention_heads=12,
                intermediate_size=3072, max_position_embeddings=512, type_vocab_size=0, relative_attention=True,
                position_buckets=256, max_relative_positions=-1, norm_rel_ebd="layer_norm", share_att_key=True,
                pos_att_type=["p2c", "c2p"], position_biased_input=False)),
            "bart_base_encoder": lambda: t.BartModel(t.BartConfig(
                d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
                decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072, vocab_size=50265,
                max_position_embeddings=1024, use_cache=False)).get_encoder(),
            "xlm_roberta_base": lambda: t.XLMRobertaModel(t.XLMRobertaConfig(
                vocab_size=250002, max_position_embeddings=514, type_vocab_size=1)),
            "clip_text": lambda: t.CLIPTextModel(t.CLIPTextConfig()),  # ViT-B/32's text tower
            "gpt_neo_125m": lambda: t.GPTNeoModel(t.GPTNeoConfig(
                vocab_size=50257, hidden_size=768, num_layers=12, num_heads=12,
                attention_types=[[["global", "local"], 6]], window_size=256, use_cache=False)),
            "pythia_160m": lambda: t.GPTNeoXModel(t.GPTNeoXConfig(
                vocab_size=50304, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                intermediate_size=3072, rotary_pct=0.25, max_position_embeddings=2048, use_cache=False)),
            # Scaled down (8 layers, hidden 1024) so they export in seconds on two cores; real block structure.
            "mistral_small": lambda: t.MistralModel(t.MistralConfig(
                hidden_size=1024, intermediate_size=3584, num_hidden_layers=8, num_attention_heads=16,
                num_key_value_heads=8, vocab_size=32000, sliding_window=4096, use_cache=False)),
            "phi_small": lambda: t.PhiModel(t.PhiConfig(
                hidden_size=1024, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=16,
                vocab_size=51200, partial_rotary_factor=0.5, use_cache=False)),
            "gemma_small": lambda: t.GemmaModel(t.GemmaConfig(
                hidden_size=1024, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=1, head_dim=128, vocab_size=32000, use_cache=False)),
        }
        vision: dict[str, Callable[[], torch.nn.Module]] = {
            "clip_vision": lambda: t.CLIPVisionModel(t.CLIPVisionConfig()),  # ViT-B/32
            "dinov2_small": lambda: t.Dinov2Model(t.Dinov2Config(
                hidden_size=384, num_hidden_layers=12, num_attention_heads=6, image_size=224, patch_size=14)),
            "swin_tiny": lambda: t.SwinModel(t.SwinConfig()),  # swin-tiny-patch4-window7-224
            "segformer_b0": lambda: t.SegformerForSemanticSegmentation(t.SegformerConfig(num_labels=150)),  # ADE20k
        }
        audio: dict[str, Callable[[], torch.nn.Module]] = {
            "wav2vec2_base": lambda: t.Wav2Vec2Model(t.Wav2Vec2Config()),
            "hubert_base": lambda: t.HubertModel(t.HubertConfig()),
        }
        if kind in configs:
            return FirstOutput(configs[kind]())
        if kind in vision:
            return Pixels(vision[kind]())
        if kind in audio:
            return Waveform(audio[kind]())
        if kind == "whisper_tiny_encoder":
            return MelFeatures(t.WhisperModel(t.WhisperConfig(
                d_model=384, encoder_layers=4, decoder_layers=4, encoder_attention_heads=6, decoder_attention_heads=6,
                encoder_ffn_dim=1536, decoder_ffn_dim=1536, num_mel_bins=80, use_cache=False)).get_encoder())
        raise KeyError(kind)
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


def _audio(kind: str, seconds: float = 1.0, batch: int = 8) -> Entry:
    samples = int(16000 * seconds)
    return Entry(_hf(kind), lambda b, device: (torch.randn(b, samples, dtype=DTYPE, device=device),),
                 "transformers", batch)


def _mel(kind: str, batch: int = 8) -> Entry:
    # Whisper's encoder takes 30 s windows: 80 mel bins x 3000 frames, whatever the clip's length.
    return Entry(_hf(kind), lambda b, device: (torch.randn(b, 80, 3000, dtype=DTYPE, device=device),),
                 "transformers", batch)


# The first 17 are the 2026-11-22 benchmark's (same architectures, inputs and batch); the next 19 came with issue 13.
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
    # issue 24, the wider corpus. torchvision: classifiers, then dense prediction (segmentation whole, detectors'
    # backbone + FPN) at their serving sizes.
    "efficientnet_v2_s": _vision(_tv("efficientnet_v2_s"), "torchvision", size=384),
    "swin_v2_t": _vision(_tv("swin_v2_t"), "torchvision", size=256),
    "maxvit_t": _vision(_tv("maxvit_t"), "torchvision"),
    "wide_resnet50_2": _vision(_tv("wide_resnet50_2"), "torchvision"),
    "resnext101_32x8d": _vision(_tv("resnext101_32x8d"), "torchvision"),
    "squeezenet1_1": _vision(_tv("squeezenet1_1"), "torchvision"),
    "regnet_x_3_2gf": _vision(_tv("regnet_x_3_2gf"), "torchvision"),
    "googlenet": _vision(_tv("googlenet"), "torchvision"),
    "inception_v3": _vision(_tv("inception_v3"), "torchvision", size=299),
    "fcn_resnet50": _vision(_tv_segmentation("fcn_resnet50"), "torchvision", batch=8, size=520),
    "deeplabv3_mobilenet_v3_large": _vision(_tv_segmentation("deeplabv3_mobilenet_v3_large"), "torchvision",
                                            batch=8, size=520),
    "lraspp_mobilenet_v3_large": _vision(_tv_segmentation("lraspp_mobilenet_v3_large"), "torchvision",
                                         batch=8, size=520),
    "retinanet_resnet50_fpn_backbone": _vision(_tv_detection_backbone("retinanet_resnet50_fpn"), "torchvision",
                                               batch=8, size=640),
    "fasterrcnn_mobilenet_v3_large_fpn_backbone": _vision(
        _tv_detection_backbone("fasterrcnn_mobilenet_v3_large_fpn"), "torchvision", batch=8, size=640),
    # timm
    "timm_convnextv2_tiny": _vision(_timm("convnextv2_tiny"), "timm"),
    "timm_efficientformer_l1": _vision(_timm("efficientformer_l1"), "timm"),
    "timm_mobilevit_s": _vision(_timm("mobilevit_s"), "timm", size=256),
    "timm_coatnet_0_rw_224": _vision(_timm("coatnet_0_rw_224"), "timm"),
    "timm_beit_base_patch16_224": _vision(_timm("beit_base_patch16_224"), "timm"),
    "timm_pvt_v2_b1": _vision(_timm("pvt_v2_b1"), "timm"),
    "timm_edgenext_small": _vision(_timm("edgenext_small"), "timm", size=256),
    "timm_fastvit_t8": _vision(_timm("fastvit_t8"), "timm", size=256),
    "timm_tiny_vit_5m_224": _vision(_timm("tiny_vit_5m_224"), "timm"),
    "timm_eva02_tiny_patch14_224": _vision(_timm("eva02_tiny_patch14_224"), "timm"),
    "timm_caformer_s18": _vision(_timm("caformer_s18"), "timm"),
    "timm_mobilenetv4_conv_medium": _vision(_timm("mobilenetv4_conv_medium"), "timm", size=256),
    "timm_cspdarknet53": _vision(_timm("cspdarknet53"), "timm", size=256),
    "timm_dla34": _vision(_timm("dla34"), "timm"),
    "timm_res2net50_26w_4s": _vision(_timm("res2net50_26w_4s"), "timm"),
    "timm_efficientvit_b1": _vision(_timm("efficientvit_b1"), "timm"),
    "timm_hrnet_w18_small_v2": _vision(_timm("hrnet_w18_small_v2"), "timm"),
    "timm_twins_svt_small": _vision(_timm("twins_svt_small"), "timm"),
    # transformers: encoders, decoders (hidden states), CLIP's towers, vision, audio
    "hf_deberta_v3_small": _text("deberta_v3_small", 128, 128100),
    "hf_bart_base_encoder": _text("bart_base_encoder", 128, 50265),
    "hf_xlm_roberta_base": _text("xlm_roberta_base", 128, 250002),
    "hf_clip_text": _text("clip_text", 77, 49408, batch=32),
    "hf_gpt_neo_125m": _text("gpt_neo_125m", 256, 50257, batch=8),
    "hf_pythia_160m": _text("pythia_160m", 256, 50304, batch=8),
    "hf_mistral_small": _text("mistral_small", 256, 32000, batch=8),
    "hf_phi_small": _text("phi_small", 256, 51200, batch=8),
    "hf_gemma_small": _text("gemma_small", 256, 32000, batch=8),
    "hf_clip_vision": Entry(_hf("clip_vision"), lambda b, device: _images(b, 224, device), "transformers", 32),
    "hf_dinov2_small": Entry(_hf("dinov2_small"), lambda b, device: _images(b, 224, device), "transformers", 32),
    "hf_swin_tiny": Entry(_hf("swin_tiny"), lambda b, device: _images(b, 224, device), "transformers", 32),
    "hf_segformer_b0": Entry(_hf("segformer_b0"), lambda b, device: _images(b, 512, device), "transformers", 8),
    "hf_wav2vec2_base": _audio("wav2vec2_base"),
    "hf_hubert_base": _audio("hubert_base"),
    "hf_whisper_tiny_encoder": _mel("whisper_tiny_encoder"),
}


# Outside the corpus (MODELS, what cover.py and bench.py run by default): ttfi.py's case of a convolution model of
# more than 400 MB (ConvNeXt-XL: 350 M parameters, 700 MB in bf16), named like any other.
LARGE: dict[str, Entry] = {
    "timm_convnext_xlarge": _vision(_timm("convnext_xlarge"), "timm"),
}


def entry_of(name: str) -> Entry:
    return MODELS[name] if name in MODELS else LARGE[name]


def inputs(name: str, batch: int | None = None, device: str = "cuda") -> tuple[Any, ...]:
    """The model's example inputs at `batch` (default: its serving batch)."""
    entry = entry_of(name)
    return tuple(entry.inputs(entry.batch if batch is None else batch, device))


def build(name: str, seed: int = 0, batch_mult: int = 1, device: str = "cuda",
          batch: int | None = None) -> tuple[torch.nn.Module, tuple[Any, ...]]:
    """The model with weights drawn from `seed` (another seed: same architecture, new weights, as a new
    checkpoint of it would be), and inputs at `batch` (default: `batch_mult` times its serving batch)."""
    entry = entry_of(name)
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
