"""FLUX.1-style rectified-flow transformer as a ComposerModel.

One training step, top to bottom: images -> 16-channel VAE latents (or precomputed posterior moments),
captions -> T5 sequence embeddings + CLIP pooled embedding (or precomputed), timestep t from a
logit-normal (optionally shifted towards noise for larger images), x_t = (1 - t) x0 + t eps, pack 2x2
latent patches into tokens with RoPE position ids, predict the velocity eps - x0, mean squared error
(the objective and its validation loss: rectified_flow.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline
from transformers import CLIPTextModel, T5EncoderModel

from diffusion.batch import IMAGE, INPUT_IDS, LATENT_MOMENTS, POOLED_TEXT_EMBEDS, T5_INPUT_IDS, TEXT_EMBEDS
from diffusion.errors import UsageError
from diffusion.models import rectified_flow
from diffusion.models.base import (
    NO_CUDNN_ATTENTION,
    Geometry,
    LatentDiffusion,
    a_third_in,
    block_stack,
    checked_text_states,
    checked_token_ids,
    hw,
    true_cfg,
    vae_factor,
)
from diffusion.models.flops import denoiser_flops, encode_flops
from diffusion.models.per_sample_rope import PerSampleRope
from diffusion.models.rectified_flow import RectifiedFlow, RectifiedFlowSteps
from diffusion.models.t5_text import T5_LENGTH, t5_length, t5_objective
from diffusion.models.tokenizer import padded_to
from diffusion.settings import Range, same_as, setting


@dataclass
class FluxObjective:
    """A FLUX run's loss options (the ``objective`` section of a recipe; a preset may set its own): the
    rectified-flow objective's, t always logit-normal."""

    logit_mean: float = same_as(RectifiedFlow, "logit_mean")
    logit_std: float = same_as(RectifiedFlow, "logit_std")
    shift: Any = same_as(RectifiedFlow, "shift")
    base_seq_len: int = same_as(RectifiedFlow, "base_seq_len")
    max_seq_len: int = same_as(RectifiedFlow, "max_seq_len")
    base_shift: float = same_as(RectifiedFlow, "base_shift")
    max_shift: float = same_as(RectifiedFlow, "max_shift")
    text_dropout: float = same_as(RectifiedFlow, "text_dropout")
    guidance: float = same_as(RectifiedFlow, "guidance")
    max_sequence_length: int = setting(
        T5_LENGTH,
        "T5 tokens per caption (from a pipeline folder: its tokenizer_2's model_max_length)",
        Range(gt=0, integer=True),
    )
    val_timesteps: int = same_as(RectifiedFlow, "val_timesteps")


class Flux(RectifiedFlowSteps, LatentDiffusion):
    NAME, DESCRIPTION = "flux", "a FLUX model"
    OBJECTIVE = FluxObjective
    PIPELINE = "FluxPipeline"
    PARTS = {
        "transformer": FluxTransformer2DModel,
        "vae": AutoencoderKL,
        "text_encoder": CLIPTextModel,
        "text_encoder_2": T5EncoderModel,
    }
    TOKENIZERS = {"tokenizer": INPUT_IDS, "tokenizer_2": T5_INPUT_IDS}
    SCHEDULER = FlowMatchEulerDiscreteScheduler
    FROZEN = ("vae", "text_encoder", "text_encoder_2")
    SDPA_KERNELS = NO_CUDNN_ATTENTION
    MUON_EXCLUDE = ("x_embedder", "context_embedder", "time_text_embed", "proj_out")
    # both streams' attention projections and feed-forward layers (diffusers' train_dreambooth_lora_flux.py); the
    # single-stream blocks' attention matches attn.to_q/k/v too
    LORA_TARGETS = (
        "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
        "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
        "ff_context.net.2",
    )  # fmt: skip
    LORA_TEXT_ENCODERS = ("text_encoder",)  # CLIP; FluxPipeline.load_lora_weights reads no T5 adapters
    LATENT_SHIFT = True  # FluxPipeline decodes latents / scaling_factor + shift_factor
    SIDES_OF_8 = False

    @classmethod
    def sampling_options(cls, pipe, guidance_scale: float, count: int) -> dict:
        """diffusers' true classifier-free guidance against the empty caption (FLUX.1 [dev]'s guidance embedding is
        not this family's), and T5's tokens as a run from the folder trains."""
        return true_cfg(t5_length(pipe.tokenizer_2), guidance_scale, count)

    BLOCKS = {
        "double": ("transformer_blocks", "num_layers"),
        "single": ("single_transformer_blocks", "num_single_layers"),
    }  # FLUX.2's transformer names its stacks the same way
    ROUTING = BLOCKS
    ROUTING_ATTENTION = {FluxAttnProcessor: PerSampleRope}
    FP8_KEEP = ("norm1.linear", "norm1_context.linear", "norm.linear")  # AdaLayerNormZero / AdaLayerNormZeroSingle

    @classmethod
    def folder_objective(cls, tokenizers: dict) -> dict:
        return t5_objective(tokenizers)

    @classmethod
    def alignable_blocks(cls, get):
        """REPA: every double- and single-stream block (the image tokens last in its output); by default the one
        a third of the way in."""
        width = get("num_attention_heads") * get("attention_head_dim")
        blocks = block_stack("double", "transformer_blocks", get("num_layers"), width, 2)
        blocks.update(block_stack("single", "single_transformer_blocks", get("num_single_layers"), width, 2))
        return blocks, a_third_in(blocks)

    # --- shapes -----------------------------------------------------------------------------------
    @staticmethod
    def geometry(configs: dict, resolution: int | None) -> Geometry:
        f = vae_factor(configs["vae"]) * 2 * configs["transformer"].get("patch_size", 1)
        return Geometry(resolution=resolution or 1024, downsample_factor=f)

    @staticmethod
    def denoiser_inputs(configs: dict) -> dict[str, dict[str, int]]:
        t = configs["transformer"]
        return {
            "vae": {"latent_channels": t["in_channels"] // (4 * t.get("patch_size", 1) ** 2)},  # 2x2 packing
            "text_encoder": {"hidden_size": t["pooled_projection_dim"]},  # CLIP's pooled output
            "text_encoder_2": {"d_model": t["joint_attention_dim"]},  # T5's states, the joint attention's context
        }

    def batch_shapes(self, image_size: int | tuple[int, int], precomputed: bool) -> dict[str, tuple]:
        height, width = hw(image_size)
        cfg = self.transformer.config
        if precomputed:
            h, w = height // self.vae_scale_factor, width // self.vae_scale_factor
            return {
                LATENT_MOMENTS: ((2 * self.latent_channels, h, w), torch.float32, None),
                TEXT_EMBEDS: ((self.text_length, cfg.joint_attention_dim), torch.float32, None),
                POOLED_TEXT_EMBEDS: ((cfg.pooled_projection_dim,), torch.float32, None),
            }
        clip = self.text_encoder.config
        return {
            IMAGE: ((3, height, width), torch.float32, None),
            INPUT_IDS: ((clip.max_position_embeddings,), torch.long, clip.vocab_size),
            T5_INPUT_IDS: ((self.text_length,), torch.long, self.text_encoder_2.config.vocab_size),
        }

    # --- conditioning ----------------------------------------------------------------------------
    def encode_text(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(T5 sequence embeddings, CLIP pooled embedding), checked against the transformer's widths."""
        with self.text_grad(batch):  # CLIP's adapters train with lora_text_encoder; T5 never does
            if TEXT_EMBEDS in batch:
                seq, pooled = batch[TEXT_EMBEDS], batch[POOLED_TEXT_EMBEDS]
            else:
                ids = checked_token_ids(batch[T5_INPUT_IDS], T5_INPUT_IDS, self.text_length)
                with torch.no_grad():
                    seq = self.text_encoder_2(ids)[0]
                pooled = self.text_encoder(batch[INPUT_IDS]).pooler_output
        cfg = self.transformer.config
        width = cfg.joint_attention_dim
        checked_text_states(seq, self.text_length, f"joint_attention_dim={width} (T5 width)", width, "encoders")
        if pooled.shape[-1] != cfg.pooled_projection_dim:
            raise UsageError(
                f"'{POOLED_TEXT_EMBEDS}' are {pooled.shape[-1]} wide; this transformer takes "
                f"pooled_projection_dim={cfg.pooled_projection_dim} (CLIP width)"
            )
        return seq, pooled

    def text_features(self, batch: dict) -> dict[str, torch.Tensor]:
        seq, pooled = self.encode_text(batch)
        return {TEXT_EMBEDS: seq, POOLED_TEXT_EMBEDS: pooled}

    # --- objective (rectified_flow.py) -------------------------------------------------------------------
    def image_tokens(self, x0: torch.Tensor) -> int:
        """The transformer's image tokens for latents ``x0`` (2x2 patches), which shift=auto reads."""
        return (x0.shape[2] // 2) * (x0.shape[3] // 2)

    def _predict(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, seq: torch.Tensor, pooled: torch.Tensor):
        """Packed (prediction, target) for clean latents x0, noise and timesteps t in [0, 1]. The text features
        enter in the latents' dtype (fp32): encoders run in bf16/fp16 (encoder_dtype) would otherwise meet an
        fp32 transformer outside autocast (precision fp32) and fail on the first matmul."""
        seq, pooled = seq.to(x0.dtype), pooled.to(x0.dtype)
        n, c, h, w = x0.shape
        if h % 2 or w % 2:
            raise UsageError(
                f"latents of {h}x{w} cannot be packed into 2x2 patches; use an image size that "
                f"is a multiple of {2 * self.vae_scale_factor}"
            )
        x_t, velocity = rectified_flow.noised(x0, noise, t)
        packed = FluxPipeline._pack_latents(x_t, n, c, h, w)
        target = FluxPipeline._pack_latents(velocity, n, c, h, w)
        img_ids = FluxPipeline._prepare_latent_image_ids(n, h // 2, w // 2, x0.device, torch.float32)
        txt_ids = torch.zeros(seq.shape[1], 3, device=x0.device)
        guidance = (
            torch.full((n,), self.objective["guidance"], device=x0.device)
            if self.transformer.config.guidance_embeds
            else None
        )
        pred = self.transformer(
            hidden_states=packed,
            encoder_hidden_states=seq,
            pooled_projections=pooled,
            timestep=t,
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=guidance,
        ).sample
        return pred, target

    def pipeline(self, tokenizers: dict):
        scheduler = self.scheduler or FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False)
        t5 = padded_to(tokenizers[T5_INPUT_IDS], self.text_length)
        return FluxPipeline(
            scheduler=scheduler,
            vae=self.vae,
            text_encoder=self.text_encoder,
            tokenizer=tokenizers[INPUT_IDS],
            text_encoder_2=self.text_encoder_2,
            tokenizer_2=t5,
            transformer=self.transformer,
        )

    # --- FLOPs ---------------------------------------------------------------------------------------
    def _denoiser_flops(self, image_size: int | tuple[int, int]) -> float:
        """One sample of (h/2)(w/2) image tokens (2x2 patches of latents)."""
        cfg = self.transformer.config
        h, w = (side // self.vae_scale_factor // 2 for side in hw(image_size))
        tokens = h * w
        return denoiser_flops(
            self,
            lambda: (
                torch.randn(1, tokens, cfg.in_channels),
                torch.randn(1, self.text_length, cfg.joint_attention_dim),
                torch.randn(1, cfg.pooled_projection_dim),
                torch.tensor([0.5]),
                torch.zeros(tokens, 3),
                torch.zeros(self.text_length, 3),
                torch.tensor([1.0]) if cfg.guidance_embeds else None,
            ),
        )

    def _encoder_flops(self, image_size: int | tuple[int, int]) -> float:
        clip_len = self.text_encoder.config.max_position_embeddings
        return (
            encode_flops(self.vae, (3, *hw(image_size)))
            + self.text_encoder_flops("text_encoder", clip_len)
            + self.text_encoder_flops("text_encoder_2", self.text_length)
        )
