"""Latent diffusion (Stable Diffusion 2 style) as a ComposerModel.

One training step, top to bottom: images -> VAE latents (or precomputed posterior moments), token ids ->
text embeddings (or precomputed embeddings), add DDPM noise at a random timestep, predict the noise (epsilon)
or the velocity (v), mean squared error. The ``objective`` section (ddpm_objective.py) picks how timesteps are
drawn (uniform, logit-normal), an offset of the noise and a per-sample weighting (min-SNR); validation keeps
evenly spread timesteps and the plain mean. The VAE and text encoder are frozen: no gradients, always in eval
mode, optionally held in a lower precision.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from torchmetrics import MeanSquaredError
from transformers import CLIPTextModel

from diffusion.batch import IMAGE, INPUT_IDS, LATENT_MOMENTS, TEXT_EMBEDS
from diffusion.errors import UsageError, spell
from diffusion.models.base import EVAL_SEED, Block, Geometry, LatentDiffusion, hw, vae_factor
from diffusion.models.ddpm_objective import (
    APPLIES_WITH,
    DDPMObjective,
    loss_weights,
    offset_noise,
    sample_timesteps,
    weighted_mse,
)
from diffusion.models.flops import denoiser_flops, encode_flops


class StableDiffusion(LatentDiffusion):
    NAME, DESCRIPTION = "sd", "an SD model"
    OPTIONS = ("prediction_type", "objective")
    OBJECTIVE = DDPMObjective
    PIPELINE = "StableDiffusionPipeline"
    PARTS = {"unet": UNet2DConditionModel, "vae": AutoencoderKL, "text_encoder": CLIPTextModel}
    TOKENIZERS = {"tokenizer": INPUT_IDS}
    SCHEDULER = DDPMScheduler
    FROZEN = ("vae", "text_encoder")
    LATENT_SHIFT = False  # StableDiffusionPipeline decodes latents / scaling_factor, no shift
    MUON_EXCLUDE = ("conv_in", "conv_out", "time_embedding", "add_embedding", "class_embedding")
    # the attention projections (diffusers' train_text_to_image_lora.py)
    LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
    LORA_TEXT_ENCODERS = ("text_encoder",)
    SAMPLERS = {"ddim": "DDIMScheduler", "euler": "EulerDiscreteScheduler"}  # --sampler's choices

    def __init__(
        self,
        scheduler: DDPMScheduler,
        *,
        prediction_type: str | None = None,
        objective: dict | None = None,
        encoder_dtype: torch.dtype | None = None,
        **parts: torch.nn.Module,
    ):
        """``parts``: the modules named in PARTS (unet, vae, text_encoder)."""
        if prediction_type is not None:
            scheduler = DDPMScheduler.from_config(scheduler.config, prediction_type=prediction_type)
        if scheduler.config.prediction_type not in ("epsilon", "v_prediction"):
            raise UsageError(
                f"prediction_type {scheduler.config.prediction_type!r} is not supported; "
                "use 'epsilon' or 'v_prediction'"
            )
        merged = self.objective_options(objective)
        super().__init__(encoder_dtype, **parts)
        self.noise_scheduler = scheduler
        self.objective = merged

    @classmethod
    def check_config(cls, cfg) -> None:
        """The family's checks, and no objective key given that the other keys make a no-op (snr_gamma
        without loss_weighting=min_snr)."""
        super().check_config(cfg)
        given = cls.objective_options(dict(cfg.objective))
        for key, (needs, value) in APPLIES_WITH.items():
            if key in cfg.objective and given[needs] != value:
                raise UsageError(
                    f"{spell(f'objective.{key}')} applies with {spell(f'objective.{needs}', value)} "
                    f"(this run has {needs}={given[needs]}); set that too or leave {key} out"
                )

    @classmethod
    def alignable_blocks(cls, get):
        """REPA: the UNet's down blocks (their output's first element), mid block and up blocks, each read as
        tokens on its feature map; by default the mid block."""
        widths, n = list(get("block_out_channels")), len(get("block_out_channels"))
        blocks = {f"down.{i}": Block(f"down_blocks.{i}", 0, w, 2 ** min(i + 1, n - 1)) for i, w in enumerate(widths)}
        if get("mid_block_type") is not None:
            blocks["mid"] = Block("mid_block", None, widths[-1], 2 ** (n - 1))
        for i, w in enumerate(reversed(widths)):
            blocks[f"up.{i}"] = Block(f"up_blocks.{i}", None, w, 2 ** max(n - 2 - i, 0))
        return blocks, "mid" if "mid" in blocks else f"down.{n - 1}"

    # --- shapes -----------------------------------------------------------------------------------
    @staticmethod
    def geometry(configs: dict, resolution: int | None) -> Geometry:
        f = vae_factor(configs["vae"])
        unet = configs["unet"]
        return Geometry(
            resolution=resolution or unet["sample_size"] * f,
            downsample_factor=f * 2 ** (len(unet["block_out_channels"]) - 1),
        )

    @staticmethod
    def denoiser_inputs(configs: dict) -> dict[str, dict[str, int]]:
        unet = configs["unet"]
        return {
            "vae": {"latent_channels": unet["in_channels"]},
            "text_encoder": {"hidden_size": unet["cross_attention_dim"]},
        }

    @property
    def prediction_type(self) -> str:
        return self.noise_scheduler.config.prediction_type

    @property
    def text_length(self) -> int:
        return self.text_encoder.config.max_position_embeddings

    def batch_shapes(self, image_size: int | tuple[int, int], precomputed: bool) -> dict[str, tuple]:
        height, width = hw(image_size)
        te = self.text_encoder.config
        if precomputed:
            h, w = height // self.vae_scale_factor, width // self.vae_scale_factor
            return {
                LATENT_MOMENTS: ((2 * self.latent_channels, h, w), torch.float32, None),
                TEXT_EMBEDS: ((self.text_length, te.hidden_size), torch.float32, None),
            }
        return {
            IMAGE: ((3, height, width), torch.float32, None),
            INPUT_IDS: ((self.text_length,), torch.long, te.vocab_size),
        }

    # --- objective -----------------------------------------------------------------------------------
    def encode_text(self, batch: dict) -> torch.Tensor:
        with self.text_grad(batch):
            if TEXT_EMBEDS in batch:
                return batch[TEXT_EMBEDS]
            return self.text_encoder(batch[INPUT_IDS])[0]

    def text_features(self, batch: dict) -> dict[str, torch.Tensor]:
        return {TEXT_EMBEDS: self.encode_text(batch)}

    def conditioning(self, batch: dict, latents: torch.Tensor) -> dict:
        """The UNet's conditioning arguments, in the latents' dtype (bf16/fp16 encoders, encoder_dtype, meet an
        fp32 UNet): SD's text embeddings (SDXL adds its pooled embedding and size/crop time ids)."""
        return {"encoder_hidden_states": self.encode_text(batch).to(latents.dtype)}

    def _predict(self, batch: dict, generator: torch.Generator | None, timesteps: torch.Tensor | None):
        """(prediction, target, timesteps); training (``timesteps`` None) draws them and offsets the noise as
        the objective says."""
        latents = self.encode_latents(batch, generator)
        cond = self.conditioning(batch, latents)
        n, device = latents.shape[0], latents.device
        noise = torch.randn(latents.shape, generator=generator, device=device, dtype=latents.dtype)
        if timesteps is None:
            timesteps = sample_timesteps(self.objective, self.noise_scheduler.config.num_train_timesteps, n, device)
            noise = offset_noise(noise, self.objective["noise_offset"])
        noisy = self.noise_scheduler.add_noise(latents, noise, timesteps)
        if self.prediction_type == "epsilon":
            target = noise
        else:
            target = self.noise_scheduler.get_velocity(latents, noise, timesteps)
        pred = self.unet(noisy, timesteps, **cond).sample
        return pred, target, timesteps

    def forward(self, batch: dict):
        """(prediction, target, each sample's loss weight or None)."""
        pred, target, timesteps = self._predict(batch, generator=None, timesteps=None)
        return pred, target, loss_weights(self.objective, self.noise_scheduler, timesteps)

    def loss(self, outputs, batch):
        """The training loss: the mean squared error, weighted per sample as the objective says. Validation's
        outputs (pred, target) carry no weights: its loss is the plain mean for every objective."""
        pred, target, *weights = outputs
        return weighted_mse(pred, target, weights[0] if weights else None)

    def eval_forward(self, batch: dict, outputs=None):
        """Deterministic: fixed-seed noise and timesteps spread evenly over the schedule."""
        if outputs is not None:
            return outputs
        n, _ = self.batch_size_and_image_size(batch)
        device = next(iter(batch.values())).device
        generator = torch.Generator(device=device).manual_seed(EVAL_SEED)
        steps = self.noise_scheduler.config.num_train_timesteps
        timesteps = ((torch.arange(n, device=device) + 0.5) * steps / n).long().clamp_(0, steps - 1)
        return self._predict(batch, generator, timesteps)[:2]

    def get_metrics(self, is_train: bool = False):
        return {} if is_train else {"ValidationLoss": MeanSquaredError()}

    def update_metric(self, batch, outputs, metric) -> None:
        pred, target = outputs
        metric.update(pred.float(), target.float())

    def pipeline(self, tokenizers: dict):
        from diffusers import DDIMScheduler, StableDiffusionPipeline

        return StableDiffusionPipeline(
            vae=self.vae,
            text_encoder=self.text_encoder,
            tokenizer=tokenizers[INPUT_IDS],
            unet=self.unet,
            scheduler=DDIMScheduler.from_config(self.noise_scheduler.config),
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )

    # --- FLOPs ---------------------------------------------------------------------------------------
    def example_conditioning(self, n: int = 1) -> dict:
        """Random conditioning of the UNet's shapes (for tracing FLOPs on the meta device)."""
        return {"encoder_hidden_states": torch.randn(n, self.text_length, self.unet.config.cross_attention_dim)}

    def _denoiser_flops(self, image_size: int | tuple[int, int]) -> float:
        h, w = (side // self.vae_scale_factor for side in hw(image_size))
        cfg = self.unet.config
        return denoiser_flops(
            self, lambda: (torch.randn(1, cfg.in_channels, h, w), torch.tensor([500])), self.example_conditioning
        )

    def _encoder_flops(self, image_size: int | tuple[int, int]) -> float:
        """The VAE's encoder and each text encoder (every frozen part but the VAE) on one caption."""
        flops = encode_flops(self.vae, (3, *hw(image_size)))
        for name in self.FROZEN:
            if name != "vae":
                flops += self.text_encoder_flops(name, self.text_length)
        return flops
