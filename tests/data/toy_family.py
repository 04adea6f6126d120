"""A toy model family, as a user adds one: PixArt-alpha's transformer (diffusers' PixArtTransformer2DModel) trained
with the rectified-flow objective on SD's autoencoder latents and T5 captions, sampled with diffusers'
PixArtAlphaPipeline. tests/test_toy_family.py copies this file into a copy of the repository as
diffusion/models/pixart.py, adds its class to build.FAMILIES (the registry's import and its entry) and runs it
through benchmark.py, FSDP2 with a resume, LoRA, export.py and generate.py; nothing else is edited.

It composes the shared pieces (rectified_flow.RectifiedFlowSteps, t5_text) and declares the rest as data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import AutoencoderKL, DPMSolverMultistepScheduler, PixArtAlphaPipeline, PixArtTransformer2DModel
from transformers import T5EncoderModel

from diffusion.batch import IMAGE, T5_INPUT_IDS
from diffusion.models.base import Geometry, LatentDiffusion, a_third_in, block_stack, hw, vae_factor
from diffusion.models.flops import denoiser_flops, encode_flops
from diffusion.models.rectified_flow import RectifiedFlow, RectifiedFlowSteps, noised
from diffusion.models.t5_text import T5_LENGTH, t5_length, t5_objective
from diffusion.models.tokenizer import padded_to
from diffusion.settings import Range, same_as, setting


@dataclass
class PixArtObjective:
    """The objective section: the rectified flow's, and T5's caption length."""

    logit_mean: float = same_as(RectifiedFlow, "logit_mean")
    logit_std: float = same_as(RectifiedFlow, "logit_std")
    shift: float = same_as(RectifiedFlow, "shift")
    text_dropout: float = same_as(RectifiedFlow, "text_dropout")
    max_sequence_length: int = setting(T5_LENGTH, "T5 tokens per caption", Range(gt=0, integer=True))
    val_timesteps: int = same_as(RectifiedFlow, "val_timesteps")


def flow_scheduler(shift: float) -> DPMSolverMultistepScheduler:
    """DPM-Solver++ on the rectified flow's sigmas, the model's output the velocity (PixArtAlphaPipeline scales its
    first latents by the scheduler's init_noise_sigma, which flow-matching Euler has not)."""
    return DPMSolverMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=shift)


class PixArt(RectifiedFlowSteps, LatentDiffusion):
    NAME, DESCRIPTION = "pixart", "a PixArt model"
    OBJECTIVE = PixArtObjective
    PIPELINE = "PixArtAlphaPipeline"
    PARTS = {"transformer": PixArtTransformer2DModel, "vae": AutoencoderKL, "text_encoder": T5EncoderModel}
    TOKENIZERS = {"tokenizer": T5_INPUT_IDS}
    SCHEDULER = DPMSolverMultistepScheduler  # with flow sigmas and flow_prediction (as SanaPipeline's)
    FROZEN = ("vae", "text_encoder")
    LATENT_SHIFT = False  # the pipeline decodes latents / scaling_factor
    BLOCKS = {"blocks": ("transformer_blocks", "num_layers")}
    LORA_TARGETS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_v")
    MUON_EXCLUDE = ("pos_embed", "adaln_single", "caption_projection", "proj_out")

    @classmethod
    def alignable_blocks(cls, get):
        width = get("num_attention_heads") * get("attention_head_dim")
        blocks = block_stack("blocks", "transformer_blocks", get("num_layers"), width, get("patch_size"), None)
        return blocks, a_third_in(blocks)

    @classmethod
    def sampling_options(cls, pipe, guidance_scale: float, count: int) -> dict:
        length = t5_length(pipe.tokenizer)
        return {"guidance_scale": guidance_scale, "max_sequence_length": length, "clean_caption": False,
                "use_resolution_binning": False}  # fmt: skip

    @classmethod
    def folder_objective(cls, tokenizers: dict) -> dict:
        return t5_objective(tokenizers)

    @staticmethod
    def geometry(configs: dict, resolution: int | None) -> Geometry:
        t, f = configs["transformer"], vae_factor(configs["vae"])
        return Geometry(resolution=resolution or t["sample_size"] * f, downsample_factor=f * t.get("patch_size", 2))

    @staticmethod
    def denoiser_inputs(configs: dict) -> dict[str, dict[str, int]]:
        t = configs["transformer"]
        return {"vae": {"latent_channels": t["in_channels"]}, "text_encoder": {"d_model": t["caption_channels"]}}

    def batch_shapes(self, image_size, precomputed: bool) -> dict[str, tuple]:
        if precomputed:
            return {}
        return {
            IMAGE: ((3, *hw(image_size)), torch.float32, None),
            T5_INPUT_IDS: ((self.text_length,), torch.long, self.text_encoder.config.vocab_size),
        }

    def encode_text(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(T5's states, their attention mask): the pipeline's prompt_embeds and prompt_attention_mask."""
        ids = batch[T5_INPUT_IDS]
        mask = (ids != self.text_encoder.config.pad_token_id).long()
        with torch.no_grad():
            return self.text_encoder(ids, attention_mask=mask)[0], mask

    def text_features(self, batch: dict) -> dict[str, torch.Tensor]:
        return {}

    def image_tokens(self, x0: torch.Tensor) -> int:
        p = self.transformer.config.patch_size
        return (x0.shape[2] // p) * (x0.shape[3] // p)

    def _predict(self, x0, noise, t, seq, mask):
        """The transformer takes x_t, the scheduler's timestep t * 1000 and the masked caption; it predicts the
        velocity noise - x0 (sampled with DPM-Solver on flow sigmas, its flow_prediction)."""
        x_t, velocity = noised(x0, noise, t)
        pred = self.transformer(
            x_t,
            encoder_hidden_states=seq.to(x0.dtype),
            encoder_attention_mask=mask,
            timestep=t * 1000,
            added_cond_kwargs={"resolution": None, "aspect_ratio": None},
        ).sample
        return pred, velocity

    def pipeline(self, tokenizers: dict):
        return PixArtAlphaPipeline(
            tokenizer=padded_to(tokenizers[T5_INPUT_IDS], self.text_length),
            text_encoder=self.text_encoder,
            vae=self.vae,
            transformer=self.transformer,
            scheduler=self.scheduler or flow_scheduler(self.objective["shift"]),
        )

    def _denoiser_flops(self, image_size) -> float:
        cfg = self.transformer.config
        h, w = (side // self.vae_scale_factor for side in hw(image_size))
        return denoiser_flops(
            self,
            lambda: (torch.randn(1, cfg.in_channels, h, w),),
            lambda: {
                "encoder_hidden_states": torch.randn(1, self.text_length, cfg.caption_channels),
                "timestep": torch.tensor([500.0]),
                "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
            },
        )

    def _encoder_flops(self, image_size) -> float:
        return encode_flops(self.vae, (3, *hw(image_size))) + self.text_encoder_flops("text_encoder", self.text_length)
