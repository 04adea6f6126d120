"""Autoencoder training: a diffusers ``AutoencoderKL`` as a ComposerModel.

A latent diffusion model is only as good as the latent space it denoises. This trains that space on your
own images with the same Trainer, recipes, checkpoints and EMA as the diffusion families:

    loss = reconstruction(decode(z), image) + kl_weight * KL(q(z | image) || N(0, I)),  z ~ q(z | image)

with reconstruction ``l1`` (the LDM autoencoders' choice; sharper) or ``mse``, both per pixel, and the KL
per latent element. No adversarial or perceptual term: those need pretrained networks (LPIPS) or a
discriminator schedule, and small domains reconstruct well without them.

While it trains, the model keeps running statistics of its latents (mean and standard deviation, over
the last few hundred batches). ``for_diffusion()`` writes them into the config as ``shift_factor`` and
``scaling_factor`` = 1 / std, which is how diffusers pipelines bring latents to unit variance. Export
(``export.py``) saves that ``AutoencoderKL`` directory; a diffusion run takes it with ``vae=DIR``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL
from torchmetrics import MeanSquaredError
from torchmetrics.image import PeakSignalNoiseRatio

from diffusion.batch import IMAGE
from diffusion.errors import UsageError
from diffusion.models.base import Family, Geometry, hw, vae_factor
from diffusion.models.flops import count_flops
from diffusion.settings import OneOf, Range, setting


@dataclass
class AutoencoderObjective:
    """An autoencoder run's loss options (the ``objective`` section of a recipe)."""

    reconstruction: str = setting("l1", "per-pixel reconstruction loss", OneOf(("l1", "mse")))
    kl_weight: float = setting(1.0e-6, "times the KL divergence per latent element", Range(ge=0))
    stats_momentum: float = setting(0.01, "running latent statistics: new = (1 - m) old + m batch", Range(gt=0, le=1))


class Autoencoder(Family):
    NAME, DESCRIPTION = "vae", "an autoencoder"
    PIPELINE = None  # a standalone model directory (AutoencoderKL.save_pretrained), not a pipeline
    PARTS = {"vae": AutoencoderKL}
    OPTIONS = ("objective",)
    OBJECTIVE = AutoencoderObjective

    def __init__(self, vae: AutoencoderKL, *, objective: dict | None = None, encoder_dtype=None):
        merged = self.objective_options(objective)
        super().__init__(encoder_dtype, vae=vae)  # trained, not frozen: encoder_dtype does not apply
        self.objective = merged
        channels = vae.config.latent_channels
        # Running per-channel first and second moments of the sampled latents (in checkpoints as buffers).
        self.register_buffer("latent_mean", torch.zeros(channels))
        self.register_buffer("latent_sq", torch.ones(channels))
        self.register_buffer("stats_batches", torch.zeros((), dtype=torch.long))
        self._flops: dict[int, float] = {}

    @classmethod
    def check_config(cls, cfg) -> None:
        super().check_config(cfg)
        used = [k for k in ("precomputed_latents", "sample_interval", "quality_interval") if getattr(cfg, k)]
        if used:
            raise UsageError(
                f"{used[0]} does not apply to an autoencoder ({cfg.model_name}): it trains on images "
                "and is judged by its validation reconstruction (ValidationLoss, PSNR)"
            )

    @staticmethod
    def geometry(configs: dict, resolution: int | None) -> Geometry:
        vae = configs["vae"]
        return Geometry(resolution=resolution or vae["sample_size"], downsample_factor=vae_factor(vae))

    def batch_shapes(self, image_size: int | tuple[int, int], precomputed: bool) -> dict[str, tuple]:
        height, width = hw(image_size)
        if precomputed:
            return {}
        return {IMAGE: ((3, height, width), torch.float32, None)}

    # --- objective -----------------------------------------------------------------------------------
    def forward(self, batch: dict):
        posterior = self.vae.encode(batch[IMAGE]).latent_dist
        z = posterior.sample()
        if self.training:
            self._track(z.detach())
        return self.vae.decode(z).sample, posterior

    @torch.no_grad()
    def _track(self, z: torch.Tensor) -> None:
        m = max(self.objective["stats_momentum"], 1.0 / float(self.stats_batches + 1))  # plain mean at first
        dims = [0, *range(2, z.dim())]
        self.latent_mean.lerp_(z.float().mean(dims), m)
        self.latent_sq.lerp_(z.float().pow(2).mean(dims), m)
        self.stats_batches += 1

    def loss(self, outputs, batch):
        recon, posterior = outputs
        target = batch[IMAGE].float()
        if self.objective["reconstruction"] == "l1":
            rec = (recon.float() - target).abs().mean()
        else:
            rec = F.mse_loss(recon.float(), target)
        kl = posterior.kl().sum() / posterior.mean.numel()
        return rec + self.objective["kl_weight"] * kl

    def eval_forward(self, batch: dict, outputs=None):
        """Deterministic: decode the posterior mean."""
        if outputs is not None:
            return outputs
        return self.vae.decode(self.vae.encode(batch[IMAGE]).latent_dist.mode()).sample, None

    def get_metrics(self, is_train: bool = False):
        if is_train:
            return {}
        return {"ValidationLoss": MeanSquaredError(), "PSNR": PeakSignalNoiseRatio(data_range=(-1.0, 1.0))}

    def update_metric(self, batch, outputs, metric) -> None:
        metric.update(outputs[0].float().clamp(-1, 1).contiguous(), batch[IMAGE].float().contiguous())

    # --- what diffusion training takes ------------------------------------------------------------------
    def latent_stats(self) -> tuple[float, float]:
        """(mean, standard deviation) of the latents over all channels, from the running moments."""
        if int(self.stats_batches) == 0:
            raise UsageError(
                "this autoencoder has not trained a single batch, so its latent statistics (the "
                "scale a diffusion model needs) are unknown; train it first"
            )
        mean = float(self.latent_mean.mean())
        var = float(self.latent_sq.mean()) - mean**2
        return mean, max(var, 1e-12) ** 0.5

    def for_diffusion(self) -> AutoencoderKL:
        """The autoencoder with ``shift_factor`` and ``scaling_factor`` set from its latent statistics."""
        mean, std = self.latent_stats()
        self.vae.register_to_config(shift_factor=mean, scaling_factor=1.0 / std)
        return self.vae

    def export(self, out: str, tokenizers: dict | None = None) -> None:
        self.for_diffusion().save_pretrained(out)

    # --- FLOPs (what the trainer's throughput figures use) ------------------------------------------------
    def flops_per_sample(self, image_size: int | tuple[int, int], online: bool = True) -> dict[str, float]:
        """Encode + decode, forward and backward (traced once per size on the meta device)."""
        if image_size not in self._flops:
            self._flops[image_size] = count_flops(
                type(self.vae), self.vae.config, train=True, args=lambda: (torch.randn(1, 3, *hw(image_size)),)
            )
        flops = self._flops[image_size]
        return {"denoiser": flops, "encoders": 0.0, "total": flops}

    def flops_per_batch(self, batch: dict) -> float:
        image = batch[IMAGE]
        h, w = image.shape[-2:]
        return image.shape[0] * self.flops_per_sample(int(h) if h == w else (int(h), int(w)))["total"]
