"""Qwen-Image's VAE (AutoencoderKLQwenImage, a causal 3D VAE fed one frame) as the families that use it take its
latents: Qwen-Image and Krea 2 (whose Krea2Pipeline decodes with the same VAE and the same per-channel
normalisation). A family composes it by listing ``QwenImageLatents`` first among its bases (its encoder FLOPs
replace the chat-template text path's, which count the VAE on one image, not one frame).

Each image is encoded as a one-frame video; the transformer's clean latents are a posterior sample (or precomputed
moments), (z - latents_mean) / latents_std per channel, as QwenImageImg2ImgPipeline._encode_vae_image makes them and
both pipelines undo before decoding.
"""

from __future__ import annotations

import torch

from diffusion.models.base import hw
from diffusion.models.flops import encode_flops


def qwen_vae_factor(vae_config) -> int:
    """The VAE's spatial downsampling (the pipelines' vae_scale_factor: 2 ** len(temperal_downsample))."""
    return 2 ** len(vae_config.get("temperal_downsample", [False, True, True]))


class QwenImageLatents:
    """The latents of Qwen-Image's VAE (see the module's docstring)."""

    LATENT_SHIFT = False  # normalised per channel (latents_mean, latents_std), not by a shift and a scale

    @property
    def vae_scale_factor(self) -> int:
        return qwen_vae_factor(self.vae.config)

    @property
    def latent_channels(self) -> int:
        return self.vae.config.z_dim

    @torch.no_grad()
    def latent_moments(self, images: torch.Tensor) -> torch.Tensor:
        """The VAE posterior's mean and log-variance (B, 2C, h, w), in fp32: each image encoded as a one-frame video."""
        x = images.to(self.encoder_dtype or images.dtype)[:, :, None]
        return self.vae.encode(x).latent_dist.parameters[:, :, 0].float()

    @torch.no_grad()
    def encode_latents(self, batch: dict, generator=None, posterior_noise=None) -> torch.Tensor:
        """The transformer's clean latents (B, C, h, w): a posterior sample (``posterior_noise`` fixes it; or LATENTS
        as they are), (z - latents_mean) / latents_std per channel."""
        z = self.sample_latents(batch, generator, posterior_noise)
        cfg = self.vae.config
        mean = torch.tensor(cfg.latents_mean, device=z.device).view(1, -1, 1, 1)
        std = torch.tensor(cfg.latents_std, device=z.device).view(1, -1, 1, 1)
        return (z - mean) / std

    def _encoder_flops(self, image_size: int | tuple[int, int]) -> float:
        """The VAE's encoder on one frame and the text body over a caption (the family's text_body_flops)."""
        return encode_flops(self.vae, (3, 1, *hw(image_size))) + self.text_body_flops()
