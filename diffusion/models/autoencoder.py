"""Autoencoder training: a diffusers ``AutoencoderKL`` (or FLUX.2's ``AutoencoderKLFlux2``, Qwen-Image's
``AutoencoderKLQwenImage``: the class a preset's or folder's config names as ``_class_name``) as a ComposerModel.

A latent diffusion model is only as good as the latent space it denoises. This trains that space on your
own images with the same Trainer, recipes, checkpoints and EMA as the diffusion families:

    loss = reconstruction(decode(z), image) + kl_weight * KL(q(z | image) || N(0, I)),  z ~ q(z | image)

with reconstruction ``l1`` (the LDM autoencoders' choice; sharper) or ``mse``, both per pixel, and the KL
per latent element. No adversarial or perceptual term: those need pretrained networks (LPIPS) or a
discriminator schedule, and small domains reconstruct well without them.

While it trains, the model keeps running statistics of its latents (mean and standard deviation, over
the last few hundred batches), as the family that takes the autoencoder normalises them (``LATENTS``):
``for_diffusion()`` writes them where that family reads them. An ``AutoencoderKL``'s go into its config as
``shift_factor`` and ``scaling_factor`` = 1 / std (over all channels), which is how diffusers pipelines bring latents
to unit variance; an ``AutoencoderKLFlux2``'s into its batch norm's running mean and variance, per channel of the 2x2
patches of the posterior's mean (how Flux2KleinPipeline normalises them); an ``AutoencoderKLQwenImage``'s (a video
VAE: an image is one frame) into its config's per-channel ``latents_mean`` and ``latents_std``. Export
(``export.py``) saves that directory; a diffusion run of the matching family takes it with ``vae=DIR``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, AutoencoderKLFlux2, AutoencoderKLQwenImage
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
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


def pooled(mean: torch.Tensor, var: torch.Tensor) -> tuple[float, float]:
    """(mean, standard deviation) over all channels, given each channel's mean and variance (equal counts)."""
    m = float(mean.mean())
    return m, max(float((var + mean**2).mean()) - m**2, 1e-12) ** 0.5


def _write_shift_scale(vae, mean: torch.Tensor, var: torch.Tensor) -> None:
    """One shift and scale over all channels: SD's and FLUX.1's pipelines'."""
    shift, std = pooled(mean, var)
    vae.register_to_config(shift_factor=shift, scaling_factor=1.0 / std)


def _write_batch_norm(vae, mean: torch.Tensor, var: torch.Tensor) -> None:
    """The batch norm's running statistics, per patch channel (FLUX.2's pipelines divide by sqrt(var + eps))."""
    vae.bn.running_mean.copy_(mean)
    vae.bn.running_var.copy_(var)


def _write_mean_std(vae, mean: torch.Tensor, var: torch.Tensor) -> None:
    """The config's per-channel latents_mean and latents_std (Qwen-Image's pipelines')."""
    vae.register_to_config(latents_mean=mean.tolist(), latents_std=var.clamp_min(1e-12).sqrt().tolist())


@dataclass(frozen=True)
class Latents:
    """How an autoencoder class's latents reach the diffusion family that takes it: the config key of its channel
    count, whether it encodes videos (an image is then one frame), the side of the patches whose channels the family
    normalises (1: the latents' own channels), which latents the family takes (``sample`` from the posterior or its
    ``mode``), where their statistics are written (``write``: the VAE, per-channel mean and variance) and its spatial
    downsampling from its config."""

    channels: str
    frames: bool
    patch: int
    posterior: str
    write: Callable[..., None]
    factor: Callable[[dict], int] = vae_factor


LATENTS: dict[type, Latents] = {
    AutoencoderKL: Latents("latent_channels", False, 1, "sample", _write_shift_scale),
    AutoencoderKLFlux2: Latents("latent_channels", False, 2, "mode", _write_batch_norm),
    AutoencoderKLQwenImage: Latents(
        "z_dim", True, 1, "sample", _write_mean_std, lambda cfg: 2 ** len(cfg.get("temperal_downsample", [0] * 3))
    ),
}
CLASSES = {cls.__name__: cls for cls in LATENTS}


class Autoencoder(Family):
    NAME, DESCRIPTION = "vae", "an autoencoder"
    PIPELINE = None  # a standalone model directory (AutoencoderKL.save_pretrained), not a pipeline
    PARTS = {"vae": AutoencoderKL}  # or another of LATENTS' classes, as the config's _class_name says (part_class)
    OPTIONS = ("objective",)
    OBJECTIVE = AutoencoderObjective

    def __init__(self, vae: torch.nn.Module, *, objective: dict | None = None, encoder_dtype=None):
        merged = self.objective_options(objective)
        super().__init__(encoder_dtype, vae=vae)  # trained, not frozen: encoder_dtype does not apply
        self.objective = merged
        self.rules = LATENTS[type(vae)]
        channels = vae.config[self.rules.channels] * self.rules.patch**2
        # Running per-channel first and second moments of the sampled latents (in checkpoints as buffers).
        self.register_buffer("latent_mean", torch.zeros(channels))
        self.register_buffer("latent_sq", torch.ones(channels))
        self.register_buffer("stats_batches", torch.zeros((), dtype=torch.long))
        self._flops: dict[int, float] = {}

    @classmethod
    def part_class(cls, part: str, config: dict) -> type:
        """The autoencoder class the config names (``_class_name``: one of LATENTS'), else ``AutoencoderKL``."""
        return CLASSES.get(config.get("_class_name"), AutoencoderKL)

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
        factor = LATENTS[Autoencoder.part_class("vae", vae)].factor(vae)
        return Geometry(resolution=resolution or vae.get("sample_size", 1024), downsample_factor=factor)

    def batch_shapes(self, image_size: int | tuple[int, int], precomputed: bool) -> dict[str, tuple]:
        height, width = hw(image_size)
        if precomputed:
            return {}
        return {IMAGE: ((3, height, width), torch.float32, None)}

    # --- objective -----------------------------------------------------------------------------------
    def encode(self, images: torch.Tensor) -> DiagonalGaussianDistribution:
        """The posterior of images (B, 3, H, W), its moments (B, 2C, h, w): a video VAE's of one frame."""
        if not self.rules.frames:
            return self.vae.encode(images).latent_dist
        return DiagonalGaussianDistribution(self.vae.encode(images[:, :, None]).latent_dist.parameters[:, :, 0])

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, H, W) of latents (B, C, h, w), unclamped (as ``AutoencoderKL.decode`` returns them; the
        metrics clamp to [-1, 1]).

        A video VAE's one frame goes through its decoder directly, not ``decode``: ``AutoencoderKLQwenImage.decode``
        clamps its output to [-1, 1], and a clamp passes no gradient where it clips. On images with a white
        background (1.0) the first steps push every pixel up to the background; once a shape's pixels pass 1 they
        are clipped, their loss no longer moves them, and the run plateaus at the all-white image (shapes at 32 px:
        L1 0.3, the white image's PSNR, for any length; unclamped it learns like ``AutoencoderKL``). Decoding one
        frame with no feature cache is what ``decode`` computes before its clamp (tests/test_autoencoder.py)."""
        if not self.rules.frames:
            return self.vae.decode(z).sample
        return self.vae.decoder(self.vae.post_quant_conv(z[:, :, None]))[:, :, 0]

    def forward(self, batch: dict):
        posterior = self.encode(batch[IMAGE])
        z = posterior.sample()
        if self.training:
            self._track((z if self.rules.posterior == "sample" else posterior.mode()).detach())
        return self.decode(z), posterior

    @torch.no_grad()
    def _track(self, z: torch.Tensor) -> None:
        """Running per-channel moments of latents z (B, C, h, w), over the channels of their patches (LATENTS)."""
        if self.rules.patch > 1:
            z = F.pixel_unshuffle(z, self.rules.patch)  # channel-major, as FLUX.2's pipelines patchify
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
        return self.decode(self.encode(batch[IMAGE]).mode()), None

    def get_metrics(self, is_train: bool = False):
        if is_train:
            return {}
        return {"ValidationLoss": MeanSquaredError(), "PSNR": PeakSignalNoiseRatio(data_range=(-1.0, 1.0))}

    def update_metric(self, batch, outputs, metric) -> None:
        metric.update(outputs[0].float().clamp(-1, 1).contiguous(), batch[IMAGE].float().contiguous())

    # --- what diffusion training takes ------------------------------------------------------------------
    def latent_stats(self) -> tuple[float, float]:
        """(mean, standard deviation) of the latents over all channels, from the running moments."""
        return pooled(*self.channel_stats())

    def channel_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, variance) per channel (of the patches, LATENTS), from the running moments."""
        if int(self.stats_batches) == 0:
            raise UsageError(
                "this autoencoder has not trained a single batch, so its latent statistics (the "
                "scale a diffusion model needs) are unknown; train it first"
            )
        mean = self.latent_mean.detach().float().cpu()
        return mean, (self.latent_sq.detach().float().cpu() - mean**2).clamp_min(0.0)

    def for_diffusion(self) -> torch.nn.Module:
        """The autoencoder with its latent statistics written where its diffusion family reads them (LATENTS)."""
        with torch.no_grad():
            self.rules.write(self.vae, *self.channel_stats())
        return self.vae

    def export(self, out: str, tokenizers: dict | None = None) -> None:
        self.for_diffusion().save_pretrained(out)

    # --- FLOPs (what the trainer's throughput figures use) ------------------------------------------------
    def flops_per_sample(self, image_size: int | tuple[int, int], online: bool = True) -> dict[str, float]:
        """Encode + decode, forward and backward (traced once per size on the meta device)."""
        if image_size not in self._flops:
            self._flops[image_size] = count_flops(
                type(self.vae),
                self.vae.config,
                train=True,
                args=lambda: (torch.randn(1, 3, *([1] if self.rules.frames else []), *hw(image_size)),),
            )
        flops = self._flops[image_size]
        return {"denoiser": flops, "encoders": 0.0, "total": flops}

    def flops_per_batch(self, batch: dict) -> float:
        image = batch[IMAGE]
        h, w = image.shape[-2:]
        return image.shape[0] * self.flops_per_sample(int(h) if h == w else (int(h), int(w)))["total"]
