"""FLUX.1-style rectified-flow transformer as a ComposerModel.

One training step, top to bottom: images -> 16-channel VAE latents (or precomputed posterior moments),
captions -> T5 sequence embeddings + CLIP pooled embedding (or precomputed), timestep t from a
logit-normal (optionally shifted towards noise for larger images), x_t = (1 - t) x0 + t eps, pack 2x2
latent patches into tokens with RoPE position ids, predict the velocity eps - x0, mean squared error
(the objective and its validation loss: rectified_flow.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline
from transformers import CLIPTextModel, T5EncoderModel

from diffusion.batch import IMAGE, INPUT_IDS, LATENT_MOMENTS, POOLED_TEXT_EMBEDS, T5_INPUT_IDS, TEXT_EMBEDS
from diffusion.errors import UsageError, spell
from diffusion.models import rectified_flow
from diffusion.models.base import Block, Geometry, LatentDiffusion, hw, vae_factor
from diffusion.models.flops import count_flops
from diffusion.models.rectified_flow import RectifiedFlow
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
        256,
        "T5 tokens per caption (from a pipeline folder: its tokenizer_2's model_max_length)",
        Range(gt=0, integer=True),
    )
    val_timesteps: int = same_as(RectifiedFlow, "val_timesteps")


def true_cfg(max_sequence_length: int, guidance_scale: float, count: int) -> dict:
    """A pipeline's true classifier-free guidance against the empty caption (FluxPipeline's and QwenImagePipeline's
    ``true_cfg_scale`` and ``negative_prompt``, none at guidance 1), its captions at ``max_sequence_length``."""
    options = {"max_sequence_length": max_sequence_length, "true_cfg_scale": guidance_scale}
    return options | ({"negative_prompt": [""] * count} if guidance_scale > 1 else {})


def t5_length(tokenizer) -> int:
    """T5 tokens per caption for a FLUX pipeline whose tokenizer_2 is ``tokenizer``: its model_max_length (what the
    folder's model was trained with, exported beside it, and what sampling pads to), or FluxObjective's default
    when it names none (transformers' sentinel for "no limit" is 1e30)."""
    length = getattr(tokenizer, "model_max_length", None)
    if isinstance(length, int) and 0 < length <= 1_000_000:
        return length
    return FluxObjective.max_sequence_length


class Flux(LatentDiffusion):
    NAME, DESCRIPTION = "flux", "a FLUX model"
    OPTIONS = ("objective",)
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
    # Not cuDNN's: on an H100 with torch 2.11 its attention backward returned NaN gradients for flux-tiny's joint
    # attention and ended flux-mid's first step in an illegal memory access (docs/performance.md, 2026-11-25).
    SDPA_KERNELS = "flash,efficient,math"
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
    FP8_KEEP = ("norm1.linear", "norm1_context.linear", "norm.linear")  # AdaLayerNormZero / AdaLayerNormZeroSingle

    @classmethod
    def folder_objective(cls, tokenizers: dict) -> dict:
        """A folder's captions take as many T5 tokens as its tokenizer_2 pads to (t5_length): a model trained at 32
        and fine-tuned at 256 would attend to 224 pad states it never saw, and sample at yet another length."""
        return {"max_sequence_length": t5_length(tokenizers[T5_INPUT_IDS])} if T5_INPUT_IDS in tokenizers else {}

    @classmethod
    def alignable_blocks(cls, get):
        """REPA: every double- and single-stream block (the image tokens last in its output); by default the one
        a third of the way in (the paper aligns SiT-XL's 8th of 28)."""
        width = get("num_attention_heads") * get("attention_head_dim")
        blocks = {f"double.{i}": Block(f"transformer_blocks.{i}", -1, width, 2) for i in range(get("num_layers"))}
        for i in range(get("num_single_layers")):
            blocks[f"single.{i}"] = Block(f"single_transformer_blocks.{i}", -1, width, 2)
        return blocks, list(blocks)[len(blocks) // 3]

    def __init__(
        self,
        transformer: FluxTransformer2DModel,
        vae: AutoencoderKL,
        text_encoder: torch.nn.Module,
        text_encoder_2: torch.nn.Module,
        scheduler=None,
        *,
        objective: dict | None = None,
        encoder_dtype: torch.dtype | None = None,
    ):
        merged = self.objective_options(objective)
        super().__init__(
            encoder_dtype, transformer=transformer, vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2
        )
        self.objective = merged
        self.scheduler = scheduler

    @classmethod
    def check_config(cls, cfg) -> None:
        if cfg.prediction_type is not None:
            raise UsageError(
                f"{spell('prediction_type')} applies to SD models; {cfg.model_name} is a {cls.NAME} model "
                "(rectified flow always predicts the velocity noise - data)"
            )
        super().check_config(cfg)

    @property
    def prediction_type(self) -> str:
        """What the denoiser predicts, as results lines record it."""
        return "flow"

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

    @property
    def text_length(self) -> int:
        return self.objective["max_sequence_length"]

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
                if batch[T5_INPUT_IDS].shape[1] > self.text_length:
                    raise UsageError(
                        f"'{T5_INPUT_IDS}' has {batch[T5_INPUT_IDS].shape[1]} tokens, more than this "
                        f"model's max_sequence_length {self.text_length}; tokenize with max_length="
                        f"{self.text_length}"
                    )
                with torch.no_grad():
                    seq = self.text_encoder_2(batch[T5_INPUT_IDS])[0]
                pooled = self.text_encoder(batch[INPUT_IDS]).pooler_output
        cfg = self.transformer.config
        if seq.shape[1] > self.text_length:
            raise UsageError(
                f"'{TEXT_EMBEDS}' has {seq.shape[1]} tokens, more than this model's "
                f"max_sequence_length {self.text_length}; precompute them again for this model (data.py "
                f"precompute), or train at objective.max_sequence_length={seq.shape[1]}"
            )
        if seq.shape[-1] != cfg.joint_attention_dim:
            raise UsageError(
                f"'{TEXT_EMBEDS}' are {seq.shape[-1]} wide; this transformer takes "
                f"joint_attention_dim={cfg.joint_attention_dim} (T5 width): precompute with this "
                "model's text encoders"
            )
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

    def forward(self, batch: dict):
        """One training step's (prediction, target): the rectified-flow objective on this family's inputs."""
        x0 = self.encode_latents(batch)
        n = x0.shape[0]
        text = rectified_flow.drop_text(self.encode_text(batch), self.objective["text_dropout"], n, x0.device)
        t = rectified_flow.sample_timesteps(self.objective, n, self.image_tokens(x0), x0.device)
        return self._predict(x0, torch.randn_like(x0), t, *text)

    def loss(self, outputs, batch):
        pred, target = outputs[0], outputs[1]
        return F.mse_loss(pred.float(), target.float())

    def eval_forward(self, batch: dict, outputs=None):
        """MLPerf validation (rectified_flow.py): t = k / val_timesteps from each sample's timestep bin, and noise
        fixed per sample id (CPU-seeded, so the same on any device)."""
        if outputs is not None:
            return outputs
        n, image_size = self.batch_size_and_image_size(batch)
        k_max = self.objective["val_timesteps"]
        bins, ids = rectified_flow.validation_bins(batch, n, k_max)
        moments_noise = None
        if IMAGE in batch or LATENT_MOMENTS in batch:  # the VAE posterior is sampled: fix its noise too
            h, w = (side // self.vae_scale_factor for side in hw(image_size))
            moments_noise = rectified_flow.fixed_noise(ids, (self.latent_channels, h, w), 10_000_000, bins.device)
        x0 = self.encode_latents(batch, posterior_noise=moments_noise)
        text = self.encode_text(batch)
        noise = rectified_flow.fixed_noise(ids, tuple(x0.shape[1:]), 0, bins.device)
        pred, target = self._predict(x0, noise, bins.float() / k_max, *text)
        return pred, target, bins

    def get_metrics(self, is_train: bool = False):
        return (
            {} if is_train else {"ValidationLoss": rectified_flow.TimestepBinnedLoss(self.objective["val_timesteps"])}
        )

    def update_metric(self, batch, outputs, metric) -> None:
        pred, target, bins = outputs
        metric.update(((pred.float() - target.float()) ** 2).flatten(1).mean(dim=1), bins)

    def t5_tokenizer(self, tokenizers: dict):
        """The T5 tokenizer, padding to this run's caption length: the pipeline (and an exported folder) pads as this
        run trains."""
        t5 = tokenizers[T5_INPUT_IDS]
        if t5.model_max_length != self.text_length:
            t5 = copy.deepcopy(t5)
            t5.model_max_length = self.text_length
        return t5

    def pipeline(self, tokenizers: dict):
        scheduler = self.scheduler or FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False)
        t5 = self.t5_tokenizer(tokenizers)
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
        cfg = self.transformer.config
        h, w = (side // self.vae_scale_factor // 2 for side in hw(image_size))
        tokens = h * w
        return count_flops(
            type(self.transformer),
            cfg,
            train=True,
            prepare=self.prepare_traced,
            args=lambda: self.traced_inputs(tokens),
        )

    def traced_inputs(self, tokens: int) -> tuple:
        """The transformer's positional inputs for one sample of ``tokens`` image tokens, as FLOP counting traces it."""
        cfg = self.transformer.config
        return (
            torch.randn(1, tokens, cfg.in_channels),
            torch.randn(1, self.text_length, cfg.joint_attention_dim),
            torch.randn(1, cfg.pooled_projection_dim),
            torch.tensor([0.5]),
            torch.zeros(tokens, 3),
            torch.zeros(self.text_length, 3),
            torch.tensor([1.0]) if cfg.guidance_embeds else None,
        )

    def _encoder_flops(self, image_size: int | tuple[int, int]) -> float:
        clip_len = self.text_encoder.config.max_position_embeddings
        return (
            count_flops(
                type(self.vae),
                self.vae.config,
                train=False,
                method="encode",
                args=lambda: (torch.randn(1, 3, *hw(image_size)),),
            )
            + self.text_encoder_flops("text_encoder", clip_len)
            + self.text_encoder_flops("text_encoder_2", self.text_length)
        )
