"""Stable Diffusion XL as a ComposerModel: SD's objective (DDPM noise, epsilon or v prediction, mean squared
error; sd.py's ``_predict``) with SDXL's conditioning.

The UNet (``addition_embed_type="text_time"``) takes three inputs besides the noisy latents and timestep:
- cross-attention context: the penultimate hidden states of two text encoders, CLIP ViT-L (``text_encoder``,
  a CLIPTextModel) and OpenCLIP ViT-bigG (``text_encoder_2``, a CLIPTextModelWithProjection), concatenated
  along the width (768 + 1280 = 2048 for SDXL-base);
- ``text_embeds``: bigG's pooled, projected embedding;
- ``time_ids``: six numbers, original size (h, w), crop top-left (top, left), target size (h, w)
  ("SDXL: Improving Latent Diffusion Models for High-Resolution Image Synthesis", Podell et al. 2023, 2.2).
  The first two come from the data (batch.py's ORIGINAL_SIZE and CROP_TOP_LEFT; a batch without them is
  taken as uncropped at its own size, as StableDiffusionXLPipeline assumes when sampling), the target size
  is the batch's image size.
Everything else (frozen VAE and encoders, eval, FLOPs, export) is SD's, with these parts and this pipeline.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKL, UNet2DConditionModel
from transformers import CLIPTextModel, CLIPTextModelWithProjection

from diffusion.batch import (
    CROP_TOP_LEFT,
    IMAGE,
    INPUT_IDS,
    INPUT_IDS_2,
    LATENT_MOMENTS,
    ORIGINAL_SIZE,
    POOLED_TEXT_EMBEDS,
    TEXT_EMBEDS,
)
from diffusion.errors import UsageError
from diffusion.models.base import hw
from diffusion.models.sd import StableDiffusion

TIME_IDS = 6  # original (h, w), crop (top, left), target (h, w)


class StableDiffusionXL(StableDiffusion):
    NAME, DESCRIPTION = "sdxl", "an SDXL model"
    PIPELINE = "StableDiffusionXLPipeline"
    PARTS = {
        "unet": UNet2DConditionModel,
        "vae": AutoencoderKL,
        "text_encoder": CLIPTextModel,
        "text_encoder_2": CLIPTextModelWithProjection,
    }
    TOKENIZERS = {"tokenizer": INPUT_IDS, "tokenizer_2": INPUT_IDS_2}
    FROZEN = ("vae", "text_encoder", "text_encoder_2")
    # the attention projections and the transformer blocks' feed-forward layers (as kohya's and SimpleTuner's SDXL
    # LoRAs train them)
    LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2")
    LORA_TEXT_ENCODERS = ("text_encoder", "text_encoder_2")

    @staticmethod
    def denoiser_inputs(configs: dict) -> dict[str, dict[str, int]]:
        """The two towers' widths add up to the UNet's cross-attention width; each is checked against what the
        other leaves. The second tower's pooled projection fills the UNet's added embedding with the time ids'."""
        unet, one, two = configs["unet"], configs["text_encoder"], configs["text_encoder_2"]
        pooled = unet["projection_class_embeddings_input_dim"] - TIME_IDS * unet["addition_time_embed_dim"]
        return {
            "vae": {"latent_channels": unet["in_channels"]},
            "text_encoder": {"hidden_size": unet["cross_attention_dim"] - two["hidden_size"]},
            "text_encoder_2": {
                "hidden_size": unet["cross_attention_dim"] - one["hidden_size"],
                "projection_dim": pooled,
            },
        }

    @property
    def pooled_width(self) -> int:
        return self.text_encoder_2.config.projection_dim

    def batch_shapes(self, image_size: int | tuple[int, int], precomputed: bool) -> dict[str, tuple]:
        height, width = hw(image_size)
        # plausible sizes for synthetic data: originals from half to twice the image size, crops up to a quarter
        sizes = {
            ORIGINAL_SIZE: ((2,), torch.long, (min(height, width) // 2, 2 * max(height, width) + 1)),
            CROP_TOP_LEFT: ((2,), torch.long, (0, min(height, width) // 4 + 1)),
        }
        if precomputed:
            h, w = height // self.vae_scale_factor, width // self.vae_scale_factor
            return {
                LATENT_MOMENTS: ((2 * self.latent_channels, h, w), torch.float32, None),
                TEXT_EMBEDS: ((self.text_length, self.unet.config.cross_attention_dim), torch.float32, None),
                POOLED_TEXT_EMBEDS: ((self.pooled_width,), torch.float32, None),
                **sizes,
            }
        return {
            IMAGE: ((3, height, width), torch.float32, None),
            INPUT_IDS: ((self.text_length,), torch.long, self.text_encoder.config.vocab_size),
            INPUT_IDS_2: ((self.text_length,), torch.long, self.text_encoder_2.config.vocab_size),
            **sizes,
        }

    # --- conditioning ----------------------------------------------------------------------------
    def encode_text(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(both towers' penultimate hidden states concatenated, bigG's pooled projection), as
        StableDiffusionXLPipeline.encode_prompt makes them."""
        with self.text_grad(batch):
            if TEXT_EMBEDS in batch:
                seq, pooled = batch[TEXT_EMBEDS], batch[POOLED_TEXT_EMBEDS]
            else:
                one = self.text_encoder(batch[INPUT_IDS], output_hidden_states=True)
                two = self.text_encoder_2(batch[INPUT_IDS_2], output_hidden_states=True)
                seq = torch.cat([one.hidden_states[-2], two.hidden_states[-2]], dim=-1)
                pooled = two.text_embeds
        cfg = self.unet.config
        if seq.shape[-1] != cfg.cross_attention_dim or pooled.shape[-1] != self.pooled_width:
            raise UsageError(
                f"'{TEXT_EMBEDS}' are {seq.shape[-1]} wide and '{POOLED_TEXT_EMBEDS}' {pooled.shape[-1]}; this "
                f"UNet takes {cfg.cross_attention_dim} and {self.pooled_width}: precompute with this model's "
                "text encoders"
            )
        return seq, pooled

    def text_features(self, batch: dict) -> dict[str, torch.Tensor]:
        seq, pooled = self.encode_text(batch)
        return {TEXT_EMBEDS: seq, POOLED_TEXT_EMBEDS: pooled}

    def sizes(self, batch: dict, n: int, image_hw: tuple[int, int], device) -> tuple[torch.Tensor, torch.Tensor]:
        """(original size, crop top-left), each (n, 2): from the batch, else the image's own size and (0, 0)."""
        original = batch.get(ORIGINAL_SIZE)
        if original is None:
            original = torch.tensor(image_hw, device=device).expand(n, 2)
        crop = batch.get(CROP_TOP_LEFT)
        if crop is None:
            crop = torch.zeros(n, 2, dtype=torch.long, device=device)
        return original, crop

    def precompute(self, batch: dict) -> dict[str, torch.Tensor]:
        """SD's (VAE moments and text features), with the sizes the time ids are made of."""
        n, size = self.batch_size_and_image_size(batch)
        original, crop = self.sizes(batch, n, hw(size), batch[IMAGE].device)
        return {**super().precompute(batch), ORIGINAL_SIZE: original, CROP_TOP_LEFT: crop}

    def conditioning(self, batch: dict, latents: torch.Tensor) -> dict:
        seq, pooled = self.encode_text(batch)
        n, _, h, w = latents.shape
        target = (h * self.vae_scale_factor, w * self.vae_scale_factor)
        original, crop = self.sizes(batch, n, target, latents.device)
        target = torch.tensor(target, device=latents.device).expand(n, 2)
        time_ids = torch.cat([original, crop, target], dim=1).to(latents.dtype)
        return {
            "encoder_hidden_states": seq.to(latents.dtype),
            "added_cond_kwargs": {"text_embeds": pooled.to(latents.dtype), "time_ids": time_ids},
        }

    def example_conditioning(self, n: int = 1) -> dict:
        return {
            **super().example_conditioning(n),
            "added_cond_kwargs": {
                "text_embeds": torch.randn(n, self.pooled_width),
                "time_ids": torch.randn(n, TIME_IDS),
            },
        }

    def pipeline(self, tokenizers: dict):
        """SDXL's sampler (Euler) on this model's noise schedule. Empty prompts are encoded, not zeroed
        (``force_zeros_for_empty_prompt=False``): caption dropout trains on the encoded empty caption."""
        from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

        return StableDiffusionXLPipeline(
            vae=self.vae,
            text_encoder=self.text_encoder,
            text_encoder_2=self.text_encoder_2,
            tokenizer=tokenizers[INPUT_IDS],
            tokenizer_2=tokenizers[INPUT_IDS_2],
            unet=self.unet,
            scheduler=EulerDiscreteScheduler.from_config(self.noise_scheduler.config),
            force_zeros_for_empty_prompt=False,
            add_watermarker=False,
        )
