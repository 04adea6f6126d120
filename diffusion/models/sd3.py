"""Stable Diffusion 3 / 3.5 (MMDiT) as a ComposerModel: the rectified-flow objective and MLPerf-style validation
(rectified_flow.py), with SD3's transformer and conditioning, as diffusers' StableDiffusion3Pipeline and its
train_dreambooth_lora_sd3.py make them.

One training step, top to bottom: images -> 16-channel VAE latents, shifted and scaled ((z - shift_factor) *
scaling_factor), or precomputed posterior moments; captions -> the text-encoder states; timestep t = sigmoid(u),
u ~ N(logit_mean, logit_std), shifted as SD3's scheduler shifts its sigmas (s t / (1 + (s - 1) t), s = 3.0);
x_t = (1 - t) x0 + t eps; the transformer (2x2 patches, its own learned position embedding) takes x_t as latents,
the timestep as t * 1000 (the scheduler's timesteps) and predicts the velocity eps - x0; mean squared error.

Text-encoder states (StableDiffusion3Pipeline.encode_prompt):
- sequence: CLIP-L's and OpenCLIP-bigG's penultimate hidden states (both CLIPTextModelWithProjection) concatenated
  on the channels (768 + 1280 = 2048), zero-padded to T5-XXL's width (4096), then concatenated on the sequence with
  T5's states: 77 + max_sequence_length tokens, ``joint_attention_dim`` wide;
- pooled: the two CLIPs' projected pooled outputs concatenated (768 + 1280 = ``pooled_projection_dim`` 2048).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
from transformers import CLIPTextModelWithProjection, T5EncoderModel

from diffusion.batch import IMAGE, INPUT_IDS, INPUT_IDS_2, LATENT_MOMENTS, POOLED_TEXT_EMBEDS, T5_INPUT_IDS, TEXT_EMBEDS
from diffusion.errors import UsageError
from diffusion.models import rectified_flow
from diffusion.models.base import (
    NO_CUDNN_ATTENTION,
    Geometry,
    LatentDiffusion,
    a_third_in,
    block_stack,
    checked_token_ids,
    hw,
    vae_factor,
)
from diffusion.models.flops import denoiser_flops, encode_flops
from diffusion.models.rectified_flow import RectifiedFlow, RectifiedFlowSteps
from diffusion.models.t5_text import t5_length, t5_objective
from diffusion.models.tokenizer import padded_to
from diffusion.settings import Range, same_as, setting


@dataclass
class SD3Objective:
    """An SD3 run's loss options (the ``objective`` section of a recipe; a preset may set its own): timestep
    sampling as train_dreambooth_lora_sd3.py's default (weighting_scheme logit_normal, mean 0, std 1) on the
    sigmas of SD3's scheduler (shift 3.0)."""

    logit_mean: float = same_as(RectifiedFlow, "logit_mean")
    logit_std: float = same_as(RectifiedFlow, "logit_std")
    shift: float = setting(3.0, "t -> s t / (1 + (s - 1) t), as SD3's scheduler shifts its sigmas", Range(gt=0))
    text_dropout: float = same_as(RectifiedFlow, "text_dropout")
    max_sequence_length: int = setting(
        256,
        "T5 tokens per caption (from a pipeline folder: its tokenizer_3's model_max_length)",
        Range(gt=0, integer=True),
    )
    val_timesteps: int = same_as(RectifiedFlow, "val_timesteps")


class StableDiffusion3(RectifiedFlowSteps, LatentDiffusion):
    NAME, DESCRIPTION = "sd3", "an SD3 model"
    OBJECTIVE = SD3Objective
    PIPELINE = "StableDiffusion3Pipeline"
    PARTS = {
        "transformer": SD3Transformer2DModel,
        "vae": AutoencoderKL,
        "text_encoder": CLIPTextModelWithProjection,
        "text_encoder_2": CLIPTextModelWithProjection,
        "text_encoder_3": T5EncoderModel,
    }
    TOKENIZERS = {"tokenizer": INPUT_IDS, "tokenizer_2": INPUT_IDS_2, "tokenizer_3": T5_INPUT_IDS}
    SCHEDULER = FlowMatchEulerDiscreteScheduler
    SDPA_KERNELS = NO_CUDNN_ATTENTION

    @classmethod
    def sampling_options(cls, pipe, guidance_scale: float, count: int) -> dict:
        """The pipeline's classifier-free guidance, with T5's tokens as a run from the folder trains (not its 256)."""
        return {"guidance_scale": guidance_scale, "max_sequence_length": t5_length(pipe.tokenizer_3)}

    FROZEN = ("vae", "text_encoder", "text_encoder_2", "text_encoder_3")
    MUON_EXCLUDE = ("pos_embed", "context_embedder", "time_text_embed", "proj_out")
    # both streams' attention projections (train_dreambooth_lora_sd3.py's default lora_layers); "attn." so that SD3.5
    # Medium's second, image-only attention (attn2) is left alone as there
    LORA_TARGETS = (
        "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
        "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    )  # fmt: skip
    LORA_TEXT_ENCODERS = ("text_encoder", "text_encoder_2")  # the CLIPs: SD3LoraLoaderMixin reads no T5 adapters
    LATENT_SHIFT = True  # StableDiffusion3Pipeline decodes latents / scaling_factor + shift_factor
    # the joint blocks, which token routing spans (joint.N; no RoPE: each token's position was added at the patch
    # embedding) and compile_blocks compiles one by one
    BLOCKS = ROUTING = {"joint": ("transformer_blocks", "num_layers")}
    FP8_KEEP = ("norm1.linear", "norm1_context.linear", "norm.linear")  # AdaLayerNormZero's modulation layers

    @classmethod
    def alignable_blocks(cls, get):
        """REPA: every joint block (the image tokens last in its output); by default the one a third of the way in."""
        width = get("num_attention_heads") * get("attention_head_dim")
        blocks = block_stack("joint", "transformer_blocks", get("num_layers"), width, get("patch_size"))
        return blocks, a_third_in(blocks)

    @classmethod
    def folder_objective(cls, tokenizers: dict) -> dict:
        return t5_objective(tokenizers)

    # --- shapes -----------------------------------------------------------------------------------
    @staticmethod
    def geometry(configs: dict, resolution: int | None) -> Geometry:
        """A folder's native size is the pipeline's default one (the transformer's sample_size in latents)."""
        t, f = configs["transformer"], vae_factor(configs["vae"])
        return Geometry(
            resolution=resolution or t.get("sample_size", 128) * f, downsample_factor=f * t.get("patch_size", 2)
        )

    @staticmethod
    def denoiser_inputs(configs: dict) -> dict[str, dict[str, int]]:
        """The two CLIPs' projections add up to the pooled width, and T5's width is the joint attention's (the
        CLIPs' states are padded to it); each CLIP's projection is checked against what the other leaves."""
        t, one, two = configs["transformer"], configs["text_encoder"], configs["text_encoder_2"]
        return {
            "vae": {"latent_channels": t.get("in_channels", 16)},
            "text_encoder": {"projection_dim": t["pooled_projection_dim"] - two["projection_dim"]},
            "text_encoder_2": {"projection_dim": t["pooled_projection_dim"] - one["projection_dim"]},
            "text_encoder_3": {"d_model": t["joint_attention_dim"]},
        }

    @property
    def clip_length(self) -> int:
        return self.text_encoder.config.max_position_embeddings

    def batch_shapes(self, image_size: int | tuple[int, int], precomputed: bool) -> dict[str, tuple]:
        height, width = hw(image_size)
        cfg = self.transformer.config
        if precomputed:
            h, w = height // self.vae_scale_factor, width // self.vae_scale_factor
            return {
                LATENT_MOMENTS: ((2 * self.latent_channels, h, w), torch.float32, None),
                TEXT_EMBEDS: ((self.clip_length + self.text_length, cfg.joint_attention_dim), torch.float32, None),
                POOLED_TEXT_EMBEDS: ((cfg.pooled_projection_dim,), torch.float32, None),
            }
        one, two = self.text_encoder.config, self.text_encoder_2.config
        return {
            IMAGE: ((3, height, width), torch.float32, None),
            INPUT_IDS: ((one.max_position_embeddings,), torch.long, one.vocab_size),
            INPUT_IDS_2: ((two.max_position_embeddings,), torch.long, two.vocab_size),
            T5_INPUT_IDS: ((self.text_length,), torch.long, self.text_encoder_3.config.vocab_size),
        }

    # --- conditioning ----------------------------------------------------------------------------
    def encode_text(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(sequence states, pooled embedding) as StableDiffusion3Pipeline.encode_prompt makes them, checked against
        the transformer's widths."""
        cfg = self.transformer.config
        with self.text_grad(batch):  # the CLIPs' adapters train with lora_text_encoder; T5 never does
            if TEXT_EMBEDS in batch:
                seq, pooled = batch[TEXT_EMBEDS], batch[POOLED_TEXT_EMBEDS]
            else:
                ids = checked_token_ids(batch[T5_INPUT_IDS], T5_INPUT_IDS, self.text_length)
                one = self.text_encoder(batch[INPUT_IDS], output_hidden_states=True)
                two = self.text_encoder_2(batch[INPUT_IDS_2], output_hidden_states=True)
                with torch.no_grad():
                    t5 = self.text_encoder_3(ids)[0]
                clip = torch.cat([one.hidden_states[-2], two.hidden_states[-2]], dim=-1)
                if clip.shape[-1] > t5.shape[-1]:
                    raise UsageError(
                        f"the CLIP towers' states are {clip.shape[-1]} wide together, wider than T5's "
                        f"{t5.shape[-1]} they are padded to; use text encoders whose widths fit"
                    )
                clip = F.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
                seq = torch.cat([clip.to(t5.dtype), t5], dim=-2)
                pooled = torch.cat([one.text_embeds, two.text_embeds], dim=-1)
        if seq.shape[-1] != cfg.joint_attention_dim or pooled.shape[-1] != cfg.pooled_projection_dim:
            raise UsageError(
                f"'{TEXT_EMBEDS}' are {seq.shape[-1]} wide and '{POOLED_TEXT_EMBEDS}' {pooled.shape[-1]}; this "
                f"transformer takes joint_attention_dim={cfg.joint_attention_dim} and pooled_projection_dim="
                f"{cfg.pooled_projection_dim}: precompute with this model's text encoders"
            )
        if seq.shape[1] > self.clip_length + self.text_length:
            raise UsageError(
                f"'{TEXT_EMBEDS}' has {seq.shape[1]} tokens, more than this model's {self.clip_length} CLIP + "
                f"max_sequence_length {self.text_length} T5 tokens; precompute them again for this model (data.py "
                f"precompute), or train at objective.max_sequence_length={seq.shape[1] - self.clip_length}"
            )
        return seq, pooled

    def text_features(self, batch: dict) -> dict[str, torch.Tensor]:
        seq, pooled = self.encode_text(batch)
        return {TEXT_EMBEDS: seq, POOLED_TEXT_EMBEDS: pooled}

    # --- objective -----------------------------------------------------------------------------------
    def _predict(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, seq: torch.Tensor, pooled: torch.Tensor):
        """(prediction, target) for clean latents x0, noise and timesteps t in [0, 1]: the transformer takes the
        scheduler's timestep t * 1000 and predicts eps - x0. The text features enter in the latents' dtype (as FLUX's)."""
        seq, pooled = seq.to(x0.dtype), pooled.to(x0.dtype)
        self.check_latent_size(*x0.shape[-2:])
        x_t, velocity = rectified_flow.noised(x0, noise, t)
        pred = self.transformer(
            hidden_states=x_t, encoder_hidden_states=seq, pooled_projections=pooled, timestep=t * 1000
        ).sample
        return pred, velocity

    def image_tokens(self, x0: torch.Tensor) -> int:
        """The transformer's image tokens for latents ``x0`` (its patches)."""
        p = self.transformer.config.patch_size
        return (x0.shape[2] // p) * (x0.shape[3] // p)

    def check_latent_size(self, h: int, w: int) -> None:
        """Latents the transformer takes: whole patches, within its learned position embedding."""
        p, most = self.transformer.config.patch_size, self.transformer.config.pos_embed_max_size
        if h % p or w % p:
            raise UsageError(
                f"latents of {h}x{w} cannot be cut into {p}x{p} patches; use an image size that "
                f"is a multiple of {p * self.vae_scale_factor}"
            )
        if most is not None and max(h, w) > most * p:
            raise UsageError(
                f"latents of {h}x{w} are larger than this transformer's position embedding (pos_embed_max_size="
                f"{most} patches: {most * p * self.vae_scale_factor} px a side); use a smaller image_size"
            )

    def pipeline(self, tokenizers: dict):
        from diffusers import StableDiffusion3Pipeline

        scheduler = self.scheduler or FlowMatchEulerDiscreteScheduler(shift=self.objective["shift"])
        return StableDiffusion3Pipeline(
            scheduler=scheduler,
            vae=self.vae,
            text_encoder=self.text_encoder,
            tokenizer=tokenizers[INPUT_IDS],
            text_encoder_2=self.text_encoder_2,
            tokenizer_2=tokenizers[INPUT_IDS_2],
            text_encoder_3=self.text_encoder_3,
            tokenizer_3=padded_to(tokenizers[T5_INPUT_IDS], self.text_length),
            transformer=self.transformer,
        )

    # --- FLOPs ---------------------------------------------------------------------------------------
    def _denoiser_flops(self, image_size: int | tuple[int, int]) -> float:
        cfg = self.transformer.config
        h, w = (side // self.vae_scale_factor for side in hw(image_size))
        self.check_latent_size(h, w)
        return denoiser_flops(
            self,
            lambda: (
                torch.randn(1, cfg.in_channels, h, w),
                torch.randn(1, self.clip_length + self.text_length, cfg.joint_attention_dim),
                torch.randn(1, cfg.pooled_projection_dim),
                torch.tensor([500.0]),
            ),
        )

    def _encoder_flops(self, image_size: int | tuple[int, int]) -> float:
        return (
            encode_flops(self.vae, (3, *hw(image_size)))
            + self.text_encoder_flops("text_encoder", self.clip_length)
            + self.text_encoder_flops("text_encoder_2", self.text_encoder_2.config.max_position_embeddings)
            + self.text_encoder_flops("text_encoder_3", self.text_length)
        )
