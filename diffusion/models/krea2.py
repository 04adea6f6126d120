"""Krea 2 (Krea, 2026) as a ComposerModel: the rules of diffusers 0.42's Krea2Pipeline and Krea2Transformer2DModel.

One training step, top to bottom: images -> 16-channel latents of Qwen-Image's VAE, sampled from the posterior and
normalised per channel (qwen_vae.py; Krea2Pipeline decodes with that VAE); captions put into Qwen-Image's prompt
template as Krea2Pipeline lays it out: the system prefix and the caption, padded (or cut) to 34 + max_sequence_length
- 5 tokens, then the template's 5-token suffix after the padding; Qwen3-VL's hidden states at the tapped layers
(``text_layers``; the pipeline's text_encoder_select_layers, 2, 5, ..., 35 of Qwen3-VL-4B), read with positions that
count real tokens only (the padding takes none, so the suffix sits where training put it), stacked per token, the
template's first 34 tokens dropped (the pipeline's prompt_template_encode_start_idx); the padding's states masked
(the pipeline's mask; stored zeroed, so precomputed states give the mask back); t uniform in [0, 1] (or
logit-normal), shifted as the pipeline's scheduler shifts its sigmas (exp(mu), mu linear in the image tokens from
0.5 at 256 to 1.15 at 6400: Krea2Pipeline's calculate_shift); x_t = (1 - t) x0 + t eps, packed 2x2 into tokens; the
transformer (a text fusion over the tapped layers, then single-stream blocks over [text, image]) takes t itself as
its timestep (1 is noise), the text mask and the (t, h, w) RoPE coordinates of Krea2Pipeline.prepare_position_ids;
it predicts the velocity eps - x0 the scheduler steps with; mean squared error. Validation is the rectified flow's
(rectified_flow.py).

The trained part is diffusers' Krea2Transformer2DModel, the text encoder transformers' Qwen3VLModel (the pipeline's
class; its vision tower unused). The distilled Turbo checkpoint has the same architecture: a folder that records
is_distilled keeps it (``distilled``), and its sampler then shifts by the fixed mu 1.15, as the pipeline does.
Krea's recommended way is to train LoRAs on the Base checkpoint and sample with them on Turbo.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    Krea2Pipeline,
    Krea2Transformer2DModel,
    QwenImagePipeline,
)
from transformers import BatchEncoding, Qwen3VLModel

from diffusion.batch import INPUT_IDS
from diffusion.errors import UsageError
from diffusion.models import rectified_flow
from diffusion.models.base import NO_CUDNN_ATTENTION, Geometry, LatentDiffusion, hw
from diffusion.models.chat_text import ChatCaptions, ChatTemplateText, ChatText, qwen_length
from diffusion.models.flops import denoiser_flops
from diffusion.models.presets.krea2 import KREA2_SCHEDULER
from diffusion.models.qwen_image import DROP, PROMPT_TEMPLATE
from diffusion.models.qwen_vae import QwenImageLatents, qwen_vae_factor
from diffusion.models.rectified_flow import TIMESTEPS, RectifiedFlow, RectifiedFlowSteps, scheduler_line
from diffusion.settings import Each, Either, OneOf, Range, same_as, setting

# Krea2Pipeline's layout (set in its __init__; tests/test_krea2.py checks them against the pipeline's): Qwen-Image's
# template cut at the caption, the suffix tokenized after the padding
PREFIX, SUFFIX = PROMPT_TEMPLATE.split("{}")
SUFFIX_TOKENS = 5  # prompt_template_encode_num_suffix_tokens
TEXT_LAYERS = (2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35)  # text_encoder_select_layers' default (Qwen3-VL-4B's)
DISTILLED_MU = 1.15  # the Turbo checkpoint's fixed shift, as Krea2Pipeline samples it


@dataclass
class Krea2Objective:
    """A Krea 2 run's loss options (the ``objective`` section of a recipe; a preset may set its own)."""

    timesteps: str = setting(
        "uniform",
        "training t: uniform in [0, 1], or logit_normal (logit_mean, logit_std); then shifted (shift)",
        OneOf(TIMESTEPS),
    )
    logit_mean: float = same_as(RectifiedFlow, "logit_mean")
    logit_std: float = same_as(RectifiedFlow, "logit_std")
    shift: Any = setting(
        "auto",
        "t -> s t / (1 + (s - 1) t); auto: s = exp(mu(image tokens)) as Krea2Pipeline's scheduler shifts its sigmas",
        Either(Range(gt=0), ("auto",)),
    )
    base_seq_len: int = same_as(RectifiedFlow, "base_seq_len")
    max_seq_len: int = setting(
        6400, "image tokens at which shift=auto gives max_shift (Krea 2's scheduler: 6400)", Range(gt=0, integer=True)
    )
    base_shift: float = same_as(RectifiedFlow, "base_shift")
    max_shift: float = same_as(RectifiedFlow, "max_shift")
    text_dropout: float = same_as(RectifiedFlow, "text_dropout")
    max_sequence_length: int = setting(
        512,
        f"Qwen3-VL states per caption after the template's {DROP} dropped tokens (the pipeline's default; from a "
        "pipeline folder: its tokenizer's model_max_length when at most 8192)",
        Range(gt=SUFFIX_TOKENS, integer=True),
    )
    pad_token_id: int = same_as(ChatText, "pad_token_id")
    text_layers: tuple = setting(
        TEXT_LAYERS,
        "the text encoder's hidden states stacked per token (0: its embeddings; Krea2Pipeline's "
        "text_encoder_select_layers, from a folder: its model_index.json's), one per transformer num_text_layers",
        Each(Range(ge=0, integer=True)),
    )
    distilled: bool = setting(
        False, "the few-step Turbo checkpoint: its sampler shifts by mu 1.15 (from a folder: its is_distilled)"
    )
    val_timesteps: int = same_as(RectifiedFlow, "val_timesteps")


class Krea2Captions(ChatCaptions):
    """A tokenizer that lays each caption out as Krea2Pipeline does: the template's prefix and the caption padded (or
    cut) to all but the suffix's tokens, then the suffix (``max_length``: the whole layout)."""

    def format(self, text: str) -> str:
        return PREFIX + text

    def __call__(self, text, max_length=None, return_tensors=None, **_):
        texts = [text] if isinstance(text, str) else list(text)
        length = (max_length or self.tokenizer.model_max_length) - SUFFIX_TOKENS
        body = self.tokenizer([self.format(t) for t in texts], padding="max_length", truncation=True,
                              max_length=length, return_tensors="pt")  # fmt: skip
        tail = self.tokenizer([SUFFIX] * len(texts), return_tensors="pt")
        encoded = {key: torch.cat([body[key], tail[key]], dim=1) for key in ("input_ids", "attention_mask")}
        if return_tensors != "pt":
            encoded = {
                key: value.tolist()[0] if isinstance(text, str) else value.tolist() for key, value in encoded.items()
            }
        return BatchEncoding(encoded)


class Krea2(QwenImageLatents, ChatTemplateText, RectifiedFlowSteps, LatentDiffusion):
    NAME, DESCRIPTION = "krea2", "a Krea 2 model"
    OBJECTIVE = Krea2Objective
    PIPELINE = "Krea2Pipeline"
    PARTS = {"transformer": Krea2Transformer2DModel, "vae": AutoencoderKLQwenImage, "text_encoder": Qwen3VLModel}
    TOKENIZERS = {"tokenizer": INPUT_IDS}
    SCHEDULER = FlowMatchEulerDiscreteScheduler
    FROZEN = ("vae", "text_encoder")
    SDPA_KERNELS = NO_CUDNN_ATTENTION
    # the embedders, the text fusion's layer projector (1 x num_text_layers) and the final layer
    MUON_EXCLUDE = ("img_in", "time_embed", "time_mod_proj", "text_fusion.projector", "txt_in", "final_layer")
    # every attention's projections (the blocks' and the text fusion's), its output gate too: the keys
    # Krea2LoraLoaderMixin reads (diffusers' conversion of Krea's and ai-toolkit's LoRAs maps attention and MLP names)
    LORA_TARGETS = ("to_q", "to_k", "to_v", "to_gate", "to_out.0")
    LORA_TEXT_ENCODERS = ()  # Krea2Pipeline.load_lora_weights reads the transformer's adapters only
    BLOCKS = {"blocks": ("transformer_blocks", "num_layers")}

    @classmethod
    def sampling_options(cls, pipe, guidance_scale: float, count: int) -> dict:
        """Krea2Pipeline's guidance adds w (cond - uncond) to cond, so w = scale - 1 (w = 0 is none), at the caption
        length a run from the folder trains with."""
        return {"guidance_scale": max(guidance_scale - 1, 0.0), "max_sequence_length": qwen_length(pipe.tokenizer)}

    @classmethod
    def pipeline_objective(cls, index: dict) -> dict:
        """The layers a folder's pipeline taps and whether it is the distilled checkpoint (its model_index.json)."""
        layers = index.get("text_encoder_select_layers")
        return {"text_layers": tuple(layers or TEXT_LAYERS), "distilled": bool(index.get("is_distilled", False))}

    @classmethod
    def caption_tokenizers(cls, tokenizers: dict) -> dict:
        return {key: Krea2Captions(tok) for key, tok in tokenizers.items()}

    def __init__(self, scheduler=None, **options):
        """The rectified flow's (rectified_flow.py: the parts, the objective, the scheduler), the shift's line the
        scheduler's unless the run sets it; the tapped layers checked against both models."""
        super().__init__(scheduler, **options)
        scheduler_line(self.objective, scheduler, options.get("objective") or {})  # the pipeline's mu is from it
        self._check_text_layers()

    def _check_text_layers(self) -> None:
        layers, cfg = tuple(self.objective["text_layers"]), self.transformer.config
        deepest = self.text_body.config.num_hidden_layers
        if len(layers) != cfg.num_text_layers or max(layers) > deepest:
            raise UsageError(
                f"objective.text_layers {list(layers)}: the transformer takes num_text_layers={cfg.num_text_layers} "
                f"tapped states of a text encoder with {deepest} layers (0..{deepest}); give that many layers in range"
            )

    # --- shapes -----------------------------------------------------------------------------------
    @staticmethod
    def geometry(configs: dict, resolution: int | None) -> Geometry:
        """A folder's native size is the pipeline's default one (1024 px); sides are whole 2x2 patches of latents."""
        return Geometry(resolution=resolution or 1024, downsample_factor=qwen_vae_factor(configs["vae"]) * 2)

    @staticmethod
    def denoiser_inputs(configs: dict) -> dict[str, dict[str, int]]:
        """The VAE (its latent channels) and the Qwen3-VL text encoder (its width, in text_config) can be swapped."""
        t = configs["transformer"]
        return {
            "vae": {"z_dim": t.get("in_channels", 64) // 4},
            "text_encoder": {"text_config.hidden_size": t.get("text_hidden_dim", 2560)},
        }

    @property
    def token_length(self) -> int:
        """Token ids per caption: the template's dropped prefix, then the states kept (the suffix's among them)."""
        return DROP + self.text_length

    @property
    def text_width(self) -> int:
        """A token's stored states: the tapped layers' side by side, layer-major (the transformer unstacks them)."""
        cfg = self.transformer.config
        return cfg.num_text_layers * cfg.text_hidden_dim

    @staticmethod
    def text_width_source(width: int) -> str:
        return "its num_text_layers tapped Qwen3-VL states of text_hidden_dim each"

    @property
    def text_body(self) -> torch.nn.Module:
        """Qwen3-VL's language model, whose hidden states are tapped (its vision tower never runs)."""
        return self.text_encoder.language_model

    # --- conditioning ----------------------------------------------------------------------------
    def text_states(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The tapped hidden states after the template's prefix, side by side per token (B, L, layers x D), the
        padding's zeroed; positions count real tokens only (Krea2Pipeline.get_text_hidden_states)."""
        positions = (mask.long().cumsum(dim=-1) - 1).clamp(min=0).unsqueeze(0).expand(3, -1, -1)
        out = self.text_encoder(
            input_ids=ids, attention_mask=mask.bool(), position_ids=positions, output_hidden_states=True,
            use_cache=False,
        )  # fmt: skip
        stacked = torch.stack([out.hidden_states[k] for k in self.objective["text_layers"]], dim=2)[:, DROP:]
        stacked = stacked * mask[:, DROP:, None, None].to(stacked.dtype)
        return stacked.flatten(2)

    @staticmethod
    def text_mask(seq: torch.Tensor) -> torch.Tensor:
        """The pipeline's prompt_embeds_mask: the tokens whose states are not the zeros the padding is stored as; a
        caption dropped whole (text_dropout's zeros) keeps every token, zeros as its states (never a row with no key)."""
        mask = seq.ne(0).any(dim=-1)
        return mask | ~mask.any(dim=1, keepdim=True)

    # --- objective -----------------------------------------------------------------------------------
    def _predict(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, seq: torch.Tensor, pooled=None):
        """Packed (prediction, target) for clean latents x0 (B, C, h, w), noise and timesteps t in [0, 1]; the text
        states enter in the latents' dtype, unstacked to (B, L, layers, D)."""
        n, c, h, w = x0.shape
        if h % 2 or w % 2:
            raise UsageError(
                f"latents of {h}x{w} cannot be packed into 2x2 patches; use an image size that is a multiple of "
                f"{2 * self.vae_scale_factor}"
            )
        cfg = self.transformer.config
        x_t, velocity = rectified_flow.noised(x0, noise, t)
        pred = self.transformer(
            hidden_states=QwenImagePipeline._pack_latents(x_t, n, c, h, w),  # Krea2Pipeline._pack_latents' layout
            encoder_hidden_states=seq.to(x0.dtype).unflatten(-1, (cfg.num_text_layers, cfg.text_hidden_dim)),
            timestep=t,
            position_ids=Krea2Pipeline.prepare_position_ids(seq.shape[1], h // 2, w // 2, x0.device),
            encoder_attention_mask=self.text_mask(seq),
        ).sample
        return pred, QwenImagePipeline._pack_latents(velocity, n, c, h, w)

    def image_tokens(self, x0: torch.Tensor) -> int:
        """The transformer's image tokens for latents ``x0`` (2x2 patches), which shift=auto reads."""
        return (x0.shape[2] // 2) * (x0.shape[3] // 2)

    def pipeline(self, tokenizers: dict):
        return Krea2Pipeline(
            scheduler=self.scheduler or FlowMatchEulerDiscreteScheduler.from_config(KREA2_SCHEDULER),
            vae=self.vae,
            text_encoder=self.text_encoder,
            tokenizer=self.pipeline_tokenizer(tokenizers),
            transformer=self.transformer,
            text_encoder_select_layers=tuple(self.objective["text_layers"]),
            is_distilled=bool(self.objective["distilled"]),
        )

    # --- FLOPs ---------------------------------------------------------------------------------------
    def _denoiser_flops(self, image_size: int | tuple[int, int]) -> float:
        """One sample with a caption of max_sequence_length tokens, masked as a padded one is."""
        cfg = self.transformer.config
        h, w = (side // self.vae_scale_factor // 2 for side in hw(image_size))
        length = self.text_length
        return denoiser_flops(
            self,
            lambda: (
                torch.randn(1, h * w, cfg.in_channels),
                torch.randn(1, length, cfg.num_text_layers, cfg.text_hidden_dim),
                torch.tensor([0.5]),
                Krea2Pipeline.prepare_position_ids(length, h, w, "meta"),
                torch.ones(1, length, dtype=torch.bool),
            ),
        )
