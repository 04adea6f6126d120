"""FLUX.2 [klein] as a ComposerModel: the rules of diffusers 0.39's Flux2KleinPipeline and its LoRA training script
(examples/dreambooth/train_dreambooth_lora_flux2_klein.py).

One training step, top to bottom: images -> 32-channel VAE latents, the posterior's mean (the mode, as the script
takes it; or precomputed moments), patchified 2x2 into 128 channels and normalised by the VAE's batch-norm running
statistics; captions, formatted by the tokenizer's chat template (as a user message, thinking off), -> the Qwen3
text encoder's hidden states after layers 9, 18 and 27 (the pipeline's text_encoder_out_layers), stacked along the
width (3 x 2560 = 7680 for klein 4B), padding masked as the pipeline masks it; timestep t uniform in [0, 1] (the
script's default weighting_scheme none; or logit-normal), x_t = (1 - t) x0 + t eps; patches packed into tokens with
4-axis (T, H, W, L) position ids for the image and (0, 0, 0, L) for the text; predict the velocity eps - x0; mean
squared error. Validation is the rectified flow's (rectified_flow.py): fixed timesteps k / N and fixed noise per
sample id. The chat template, the caption length a folder's tokenizer records and the padding mask are
chat_text.py's.

The trained part is diffusers' Flux2Transformer2DModel, the text encoder Qwen3ForCausalLM (its LM head unused: the
states are read from its body). FLUX.2 [dev] (Flux2Pipeline: a Mistral3ForConditionalGeneration encoder with a
processor as its tokenizer, layers 10/20/30, guidance embedding) is its subclass in flux2_dev.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import diffusers
import torch
from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel
from diffusers.models.transformers.transformer_flux2 import Flux2AttnProcessor, Flux2ParallelSelfAttnProcessor
from transformers import Qwen3ForCausalLM

from diffusion.batch import INPUT_IDS, LATENTS
from diffusion.errors import UsageError
from diffusion.models import rectified_flow
from diffusion.models.base import NO_CUDNN_ATTENTION, Geometry, LatentDiffusion, a_third_in, block_stack, hw, vae_factor
from diffusion.models.chat_text import (
    ChatCaptions,  # noqa: F401 (where checkpoints pickled before 2026-12-03 find it)
    ChatTemplateText,
    ChatText,
    qwen_length,
)
from diffusion.models.flops import denoiser_flops
from diffusion.models.per_sample_rope import PerSampleRopeFlux2, PerSampleRopeParallel
from diffusion.models.presets.flux2 import FLUX2_SCHEDULER
from diffusion.models.rectified_flow import TIMESTEPS, RectifiedFlow, RectifiedFlowSteps
from diffusion.settings import OneOf, same_as, setting

TEXT_LAYERS = (9, 18, 27)  # Flux2KleinPipeline's text_encoder_out_layers: the hidden states it stacks


@dataclass
class Flux2Objective:
    """A FLUX.2 run's loss options (the ``objective`` section of a recipe; a preset may set its own): FLUX.1's, with
    FLUX.2's timestep draw, caption length and padding id."""

    timesteps: str = setting(
        "uniform",
        "training t: uniform in [0, 1] (diffusers' FLUX.2 scripts' default), or logit_normal (logit_mean, logit_std); "
        "then shifted (shift)",
        OneOf(TIMESTEPS),
    )
    logit_mean: float = same_as(RectifiedFlow, "logit_mean")
    logit_std: float = same_as(RectifiedFlow, "logit_std")
    shift: Any = same_as(RectifiedFlow, "shift")
    base_seq_len: int = same_as(RectifiedFlow, "base_seq_len")
    max_seq_len: int = same_as(RectifiedFlow, "max_seq_len")
    base_shift: float = same_as(RectifiedFlow, "base_shift")
    max_shift: float = same_as(RectifiedFlow, "max_shift")
    text_dropout: float = same_as(RectifiedFlow, "text_dropout")
    guidance: float = same_as(RectifiedFlow, "guidance")
    max_sequence_length: int = same_as(ChatText, "max_sequence_length")
    pad_token_id: int = same_as(ChatText, "pad_token_id")
    val_timesteps: int = same_as(RectifiedFlow, "val_timesteps")


class Flux2(ChatTemplateText, RectifiedFlowSteps, LatentDiffusion):
    NAME, DESCRIPTION = "flux2", "a FLUX.2 model"
    OBJECTIVE = Flux2Objective
    PIPELINE = "Flux2KleinPipeline"
    PARTS = {"transformer": Flux2Transformer2DModel, "vae": AutoencoderKLFlux2, "text_encoder": Qwen3ForCausalLM}
    TOKENIZERS = {"tokenizer": INPUT_IDS}
    SCHEDULER = FlowMatchEulerDiscreteScheduler
    FROZEN = ("vae", "text_encoder")
    SDPA_KERNELS = NO_CUDNN_ATTENTION
    LATENT_SHIFT = True  # (encode_latents normalises by the VAE's batch-norm statistics instead)
    MUON_EXCLUDE = (
        "x_embedder", "context_embedder", "time_guidance_embed", "double_stream_modulation_img",
        "double_stream_modulation_txt", "single_stream_modulation", "norm_out", "proj_out",
    )  # fmt: skip
    # diffusers' train_dreambooth_lora_flux2_klein.py: the double-stream blocks' attention projections, the
    # single-stream blocks' fused QKV+MLP input and their output (named per block in __init__: a suffix "attn.to_out"
    # would also match the double-stream blocks' to_out ModuleList)
    LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "to_qkv_mlp_proj")
    LORA_TEXT_ENCODERS = ()  # Flux2KleinPipeline.load_lora_weights reads the transformer's adapters only

    @classmethod
    def sampling_options(cls, pipe, guidance_scale: float, count: int) -> dict:
        """The pipeline's guidance (klein's classifier-free; [dev]'s its guidance embedding's input) and the caption
        length a run from the folder trains with ([dev]'s tokenizer is a processor's)."""
        length = qwen_length(getattr(pipe.tokenizer, "tokenizer", pipe.tokenizer))
        return {"guidance_scale": guidance_scale, "max_sequence_length": length}

    TEXT_LAYERS = TEXT_LAYERS  # the text encoder's hidden states the pipeline stacks
    BLOCKS = {
        "double": ("transformer_blocks", "num_layers"),
        "single": ("single_transformer_blocks", "num_single_layers"),
    }
    ROUTING = BLOCKS  # token routing (routing.py): the double-stream blocks, then the single-stream ones
    ROUTING_ATTENTION = {Flux2AttnProcessor: PerSampleRopeFlux2, Flux2ParallelSelfAttnProcessor: PerSampleRopeParallel}
    FP8_KEEP = ()  # the modulations are outside the blocks, shared by all of them

    @classmethod
    def alignable_blocks(cls, get):
        """REPA: the double-stream blocks (their image stream is the second output); the single-stream blocks
        return the joined text+image stream, which repa.py cannot take apart. Default: the one a third of the way."""
        width = get("num_attention_heads") * get("attention_head_dim")
        blocks = block_stack("double", "transformer_blocks", get("num_layers"), width, 2)
        return blocks, a_third_in(blocks)

    def __init__(self, scheduler=None, **options):
        """The rectified flow's (rectified_flow.py: the parts, the objective, the scheduler); then LoRA's targets named
        per single-stream block."""
        super().__init__(scheduler, **options)
        self.LORA_TARGETS = (
            *type(self).LORA_TARGETS,
            *(f"single_transformer_blocks.{i}.attn.to_out" for i in range(self.transformer.config.num_single_layers)),
        )

    # --- shapes -----------------------------------------------------------------------------------
    @staticmethod
    def geometry(configs: dict, resolution: int | None) -> Geometry:
        return Geometry(resolution=resolution or 1024, downsample_factor=vae_factor(configs["vae"]) * 2)

    @staticmethod
    def denoiser_inputs(configs: dict) -> dict[str, dict[str, int]]:
        t = configs["transformer"]
        return {
            "vae": {"latent_channels": t.get("in_channels", 128) // 4},  # 2x2 patches
            "text_encoder": {"hidden_size": t.get("joint_attention_dim", 15360) // len(TEXT_LAYERS)},
        }

    @property
    def text_body(self) -> torch.nn.Module:
        """The Qwen3 body that gives the text states (its LM head never runs)."""
        return self.text_encoder.model

    # --- conditioning ----------------------------------------------------------------------------
    @torch.no_grad()
    def encode_latents(self, batch: dict, generator=None, posterior_noise=None) -> torch.Tensor:
        """The transformer's clean latents (B, 4C, h/2, w/2): the posterior's mean (or LATENTS as they are), 2x2
        patches, normalised by the VAE's batch-norm running statistics (Flux2KleinPipeline._encode_vae_image)."""
        z = batch[LATENTS].float() if LATENTS in batch else self.posterior_moments(batch)[:, : self.latent_channels]
        h, w = z.shape[-2:]
        if h % 2 or w % 2:
            raise UsageError(
                f"latents of {h}x{w} cannot be cut into 2x2 patches; use an image size that is a multiple of "
                f"{2 * self.vae_scale_factor}"
            )
        z = Flux2KleinPipeline._patchify_latents(z)
        bn = self.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(z)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1).to(z) + self.vae.config.batch_norm_eps)
        return (z - mean) / std

    def text_states(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The text body's hidden states after layers TEXT_LAYERS (klein: 9, 18 and 27), stacked along the width
        (Flux2KleinPipeline's)."""
        out = self.text_body(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
        stacked = torch.stack([out.hidden_states[k] for k in self.TEXT_LAYERS], dim=2)  # (B, L, 3, D)
        return stacked.flatten(2)  # the pipeline's permute + reshape: layer-major within each token

    @staticmethod
    def text_width_source(width: int) -> str:
        """What the transformer's text width is made of, for messages."""
        return f"{len(TEXT_LAYERS)} Qwen3 layers of {width // len(TEXT_LAYERS)}"

    # --- objective (rectified_flow.py) -------------------------------------------------------------------
    def image_tokens(self, x0: torch.Tensor) -> int:
        """The transformer's image tokens for latents ``x0``: already patchified (2x2 into channels), one a position."""
        return x0.shape[2] * x0.shape[3]

    def _predict(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, seq: torch.Tensor, pooled=None):
        """Packed (prediction, target) for clean patchified latents x0, noise and timesteps t in [0, 1]; the text
        states enter in the latents' dtype (see flux.py)."""
        seq = seq.to(x0.dtype)
        x_t, velocity = rectified_flow.noised(x0, noise, t)
        guidance = (
            torch.full((x0.shape[0],), self.objective["guidance"], device=x0.device)
            if self.transformer.config.guidance_embeds
            else None
        )
        pred = self.transformer(
            hidden_states=Flux2KleinPipeline._pack_latents(x_t),
            encoder_hidden_states=seq,
            timestep=t,
            img_ids=Flux2KleinPipeline._prepare_latent_ids(x0).to(x0.device),
            txt_ids=Flux2KleinPipeline._prepare_text_ids(seq).to(x0.device),
            guidance=guidance,
        ).sample
        return pred, Flux2KleinPipeline._pack_latents(velocity)

    def pipeline(self, tokenizers: dict):
        return getattr(diffusers, self.PIPELINE)(
            scheduler=self.scheduler or FlowMatchEulerDiscreteScheduler.from_config(FLUX2_SCHEDULER),
            vae=self.vae,
            text_encoder=self.text_encoder,
            tokenizer=self.pipeline_tokenizer(tokenizers),
            transformer=self.transformer,
        )

    # --- FLOPs ---------------------------------------------------------------------------------------
    def _denoiser_flops(self, image_size: int | tuple[int, int]) -> float:
        """One sample of (h/2)(w/2) image tokens (2x2 patches of latents)."""
        guided = self.transformer.config.guidance_embeds  # [dev]'s: its input drawn on the tracing device
        return denoiser_flops(self, lambda: (*packed_inputs(self, image_size), torch.tensor([1.0]) if guided else None))


def packed_inputs(model, image_size: int | tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """One sample's first transformer inputs, as FLUX.2's and FLUX.3's transformers take them, for tracing: (h/2)(w/2)
    image tokens (2x2 patches of latents), a caption of max_sequence_length text states, the timestep, 4-axis ids."""
    cfg, length = model.transformer.config, model.text_length
    h, w = (side // model.vae_scale_factor // 2 for side in hw(image_size))
    return (
        torch.randn(1, h * w, cfg.in_channels),
        torch.randn(1, length, cfg.joint_attention_dim),
        torch.tensor([0.5]),
        torch.zeros(h * w, 4),
        torch.zeros(length, 4),
    )
