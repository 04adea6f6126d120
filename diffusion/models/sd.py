"""Latent diffusion (Stable Diffusion 2 style) as a ComposerModel.

One training step, top to bottom: images -> VAE latents (or precomputed posterior moments), token ids ->
text embeddings (or precomputed embeddings), add DDPM noise at a uniform random timestep, predict the
noise (epsilon) or the velocity (v), mean squared error. The VAE and text encoder are frozen: no
gradients, always in eval mode, optionally held in a lower precision.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from composer.models import ComposerModel
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from torchmetrics import MeanSquaredError

from diffusion.models.flops import count_flops

# Batch keys. Online: IMAGE (B,3,H,W in [-1,1]) and INPUT_IDS (B,L). Precomputed: LATENT_MOMENTS
# (B,2C,h,w: VAE posterior mean and log-variance, sampled each step) or LATENTS (B,C,h,w, unscaled), and
# TEXT_EMBEDS (B,L,D).
IMAGE, INPUT_IDS = "image", "input_ids"
LATENT_MOMENTS, LATENTS, TEXT_EMBEDS = "latent_moments", "latents", "text_embeds"

EVAL_SEED = 1234  # fixed noise and posterior samples at eval, so validation losses compare across evals


class StableDiffusion(ComposerModel):
    def __init__(self, unet: UNet2DConditionModel, vae: AutoencoderKL, text_encoder: torch.nn.Module,
                 noise_scheduler: DDPMScheduler, *, encoder_dtype: torch.dtype | None = None):
        super().__init__()
        if noise_scheduler.config.prediction_type not in ("epsilon", "v_prediction"):
            raise ValueError(f"prediction_type {noise_scheduler.config.prediction_type!r} is not supported; "
                             "use 'epsilon' or 'v_prediction'")
        self.unet = unet
        self.vae = vae
        self.text_encoder = text_encoder
        self.noise_scheduler = noise_scheduler
        for frozen in (self.vae, self.text_encoder):
            frozen.requires_grad_(False)
            frozen.eval()
            if encoder_dtype is not None:
                frozen.to(encoder_dtype)
        self.encoder_dtype = encoder_dtype
        self._flops_per_sample: dict[tuple, float] = {}

    # --- shapes -----------------------------------------------------------------------------------
    @property
    def prediction_type(self) -> str:
        return self.noise_scheduler.config.prediction_type

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def downsample_factor(self) -> int:
        """Image sizes must be multiples of this: the VAE's factor times the UNet's own downsampling."""
        return self.vae_scale_factor * 2 ** (len(self.unet.config.block_out_channels) - 1)

    @property
    def latent_channels(self) -> int:
        return self.vae.config.latent_channels

    @property
    def text_width(self) -> int:
        return self.text_encoder.config.hidden_size

    @property
    def text_length(self) -> int:
        return self.text_encoder.config.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.text_encoder.config.vocab_size

    def train(self, mode: bool = True):
        super().train(mode)
        self.vae.eval()
        self.text_encoder.eval()
        return self

    # --- encoders (frozen) --------------------------------------------------------------------------
    @torch.no_grad()
    def encode_latents(self, batch: dict, generator: torch.Generator | None = None) -> torch.Tensor:
        """Scaled latents: sampled from the VAE posterior (online or stored moments) or given as is."""
        cfg = self.vae.config
        if LATENTS in batch:
            z = batch[LATENTS].float()
        else:
            if LATENT_MOMENTS in batch:
                moments = batch[LATENT_MOMENTS].float()
            else:
                images = batch[IMAGE].to(self.encoder_dtype or batch[IMAGE].dtype)
                moments = self.vae.quant_conv(self.vae.encoder(images)) if cfg.use_quant_conv else \
                    self.vae.encoder(images)
                moments = moments.float()
            z = DiagonalGaussianDistribution(moments).sample(generator=generator)
        shift = getattr(cfg, "shift_factor", None) or 0.0
        return (z - shift) * cfg.scaling_factor

    @torch.no_grad()
    def encode_text(self, batch: dict) -> torch.Tensor:
        if TEXT_EMBEDS in batch:
            return batch[TEXT_EMBEDS]
        return self.text_encoder(batch[INPUT_IDS])[0]

    # --- objective -----------------------------------------------------------------------------------
    def _predict(self, batch: dict, generator: torch.Generator | None, timesteps: torch.Tensor | None):
        latents = self.encode_latents(batch, generator)
        cond = self.encode_text(batch)
        n, device = latents.shape[0], latents.device
        noise = torch.randn(latents.shape, generator=generator, device=device, dtype=latents.dtype)
        if timesteps is None:
            timesteps = torch.randint(0, self.noise_scheduler.config.num_train_timesteps, (n,), device=device)
        noisy = self.noise_scheduler.add_noise(latents, noise, timesteps)
        if self.prediction_type == "epsilon":
            target = noise
        else:
            target = self.noise_scheduler.get_velocity(latents, noise, timesteps)
        pred = self.unet(noisy, timesteps, encoder_hidden_states=cond).sample
        return pred, target

    def forward(self, batch: dict):
        return self._predict(batch, generator=None, timesteps=None)

    def loss(self, outputs, batch):
        pred, target = outputs
        return F.mse_loss(pred.float(), target.float())

    def eval_forward(self, batch: dict, outputs=None):
        """Deterministic: fixed-seed noise and timesteps spread evenly over the schedule."""
        if outputs is not None:
            return outputs
        device = next(iter(batch.values())).device
        n = next(iter(batch.values())).shape[0]
        generator = torch.Generator(device=device).manual_seed(EVAL_SEED)
        steps = self.noise_scheduler.config.num_train_timesteps
        timesteps = ((torch.arange(n, device=device) + 0.5) * steps / n).long().clamp_(0, steps - 1)
        return self._predict(batch, generator, timesteps)

    def get_metrics(self, is_train: bool = False):
        return {} if is_train else {"ValidationLoss": MeanSquaredError()}

    def update_metric(self, batch, outputs, metric) -> None:
        pred, target = outputs
        metric.update(pred.float(), target.float())

    # --- FLOPs ---------------------------------------------------------------------------------------
    def flops_per_sample(self, image_size: int, online: bool = True) -> dict[str, float]:
        """Analytic-by-tracing FLOPs of one training sample: UNet forward + backward, plus the frozen
        encoders' forward when they run online. Counted once per shape on the meta device."""
        key = (image_size, online)
        if key not in self._flops_per_sample:
            h = image_size // self.vae_scale_factor
            unet = count_flops(type(self.unet), self.unet.config, train=True, args=lambda: (
                torch.randn(1, self.unet.config.in_channels, h, h), torch.tensor([500]),
                torch.randn(1, self.text_length, self.unet.config.cross_attention_dim)))
            flops = {"denoiser": unet, "encoders": 0.0}
            if online:
                flops["encoders"] = (
                    count_flops(type(self.vae), self.vae.config, train=False, method="encode",
                                args=lambda: (torch.randn(1, 3, image_size, image_size),))
                    + count_flops(type(self.text_encoder), self.text_encoder.config, train=False,
                                  args=lambda: (torch.zeros(1, self.text_length, dtype=torch.long),)))
            flops["total"] = flops["denoiser"] + flops["encoders"]
            self._flops_per_sample[key] = flops
        return self._flops_per_sample[key]

    def flops_per_batch(self, batch: dict) -> float:
        """Used by Composer's SpeedMonitor for MFU."""
        online = IMAGE in batch
        if online:
            n, size = batch[IMAGE].shape[0], batch[IMAGE].shape[-1]
        else:
            latents = batch.get(LATENTS, batch.get(LATENT_MOMENTS))
            n, size = latents.shape[0], latents.shape[-1] * self.vae_scale_factor
        return n * self.flops_per_sample(size, online=online or INPUT_IDS in batch)["total"]
