"""A toy model family, as a user adds one: AuraFlow's transformer (diffusers' AuraFlowTransformer2DModel: MMDiT blocks,
then single-stream DiT blocks) trained with the rectified-flow objective on SD's autoencoder latents and UMT5
captions, sampled with diffusers' AuraFlowPipeline. tests/test_toy_family.py copies this file into a copy of the
repository as diffusion/models/auraflow.py, adds its class to build.FAMILIES (the registry's import and its entry) and
runs it through benchmark.py, FSDP2 with a resume, LoRA, export.py and generate.py; nothing else is edited.

It composes the shared pieces (rectified_flow.RectifiedFlowSteps, t5_text) and declares the rest as data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import AuraFlowPipeline, AuraFlowTransformer2DModel, AutoencoderKL, FlowMatchEulerDiscreteScheduler
from transformers import UMT5EncoderModel

from diffusion.batch import IMAGE, T5_INPUT_IDS
from diffusion.models.base import Geometry, LatentDiffusion, a_third_in, block_stack, hw, vae_factor
from diffusion.models.flops import denoiser_flops, encode_flops
from diffusion.models.rectified_flow import RectifiedFlow, RectifiedFlowSteps, noised
from diffusion.models.t5_text import T5_LENGTH, t5_length, t5_objective
from diffusion.models.tokenizer import padded_to
from diffusion.settings import Range, same_as, setting


@dataclass
class AuraFlowObjective:
    """The objective section: the rectified flow's, and the caption length."""

    logit_mean: float = same_as(RectifiedFlow, "logit_mean")
    logit_std: float = same_as(RectifiedFlow, "logit_std")
    shift: float = same_as(RectifiedFlow, "shift")
    text_dropout: float = same_as(RectifiedFlow, "text_dropout")
    max_sequence_length: int = setting(T5_LENGTH, "UMT5 tokens per caption", Range(gt=0, integer=True))
    val_timesteps: int = same_as(RectifiedFlow, "val_timesteps")


class AuraFlow(RectifiedFlowSteps, LatentDiffusion):
    NAME, DESCRIPTION = "auraflow", "an AuraFlow model"
    OBJECTIVE = AuraFlowObjective
    PIPELINE = "AuraFlowPipeline"
    PARTS = {"transformer": AuraFlowTransformer2DModel, "vae": AutoencoderKL, "text_encoder": UMT5EncoderModel}
    TOKENIZERS = {"tokenizer": T5_INPUT_IDS}
    SCHEDULER = FlowMatchEulerDiscreteScheduler
    FROZEN = ("vae", "text_encoder")
    LATENT_SHIFT = False  # the pipeline decodes latents / scaling_factor
    BLOCKS = {"joint": ("joint_transformer_blocks", "num_mmdit_layers"),
              "single": ("single_transformer_blocks", "num_single_dit_layers")}  # fmt: skip
    LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    LORA_TEXT_ENCODERS = ()
    MUON_EXCLUDE = ("pos_embed", "time_step_proj", "context_embedder", "register_tokens", "norm_out", "proj_out")

    @classmethod
    def alignable_blocks(cls, get):
        width = get("num_attention_heads") * get("attention_head_dim")
        blocks = block_stack("joint", "joint_transformer_blocks", get("num_mmdit_layers"), width, get("patch_size"))
        return blocks, a_third_in(blocks)

    @classmethod
    def sampling_options(cls, pipe, guidance_scale: float, count: int) -> dict:
        return {"guidance_scale": guidance_scale, "max_sequence_length": t5_length(pipe.tokenizer)}

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
        return {"vae": {"latent_channels": t["in_channels"]}, "text_encoder": {"d_model": t["joint_attention_dim"]}}

    def batch_shapes(self, image_size, precomputed: bool) -> dict[str, tuple]:
        if precomputed:
            return {}
        return {
            IMAGE: ((3, *hw(image_size)), torch.float32, None),
            T5_INPUT_IDS: ((self.text_length,), torch.long, self.text_encoder.config.vocab_size),
        }

    def encode_text(self, batch: dict) -> tuple[torch.Tensor, None]:
        """UMT5's states, the padding's zeroed: the pipeline's prompt_embeds (it passes the transformer no mask)."""
        ids = batch[T5_INPUT_IDS]
        mask = (ids != self.text_encoder.config.pad_token_id).long()
        with torch.no_grad():
            return self.text_encoder(ids, attention_mask=mask)[0] * mask[..., None], None

    def text_features(self, batch: dict) -> dict[str, torch.Tensor]:
        return {}

    def image_tokens(self, x0: torch.Tensor) -> int:
        p = self.transformer.config.patch_size
        return (x0.shape[2] // p) * (x0.shape[3] // p)

    def _predict(self, x0, noise, t, seq, pooled=None):
        """The transformer takes x_t, t itself (the pipeline's timestep / 1000: 1 is noise) and the caption; it predicts
        the velocity noise - x0 its flow-matching Euler scheduler steps with."""
        x_t, velocity = noised(x0, noise, t)
        return self.transformer(x_t, encoder_hidden_states=seq.to(x0.dtype), timestep=t).sample, velocity

    def pipeline(self, tokenizers: dict):
        return AuraFlowPipeline(
            tokenizer=padded_to(tokenizers[T5_INPUT_IDS], self.text_length),
            text_encoder=self.text_encoder,
            vae=self.vae,
            transformer=self.transformer,
            scheduler=self.scheduler or FlowMatchEulerDiscreteScheduler(shift=self.objective["shift"]),
        )

    def _denoiser_flops(self, image_size) -> float:
        cfg = self.transformer.config
        h, w = (side // self.vae_scale_factor for side in hw(image_size))
        return denoiser_flops(
            self,
            lambda: (torch.randn(1, cfg.in_channels, h, w),),
            lambda: {
                "encoder_hidden_states": torch.randn(1, self.text_length, cfg.joint_attention_dim),
                "timestep": torch.tensor([0.5]),
            },
        )

    def _encoder_flops(self, image_size) -> float:
        return encode_flops(self.vae, (3, *hw(image_size))) + self.text_encoder_flops("text_encoder", self.text_length)
