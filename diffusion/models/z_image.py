"""Z-Image (Tongyi-MAI, 2025) as a ComposerModel: the rules of diffusers 0.39's ZImagePipeline and its LoRA training
script (examples/dreambooth/train_dreambooth_lora_z_image.py).

One training step, top to bottom: images -> 16-channel FLUX.1 VAE latents, the posterior's mean (the mode, as the
script takes it; or precomputed moments), shifted and scaled ((z - shift_factor) * scaling_factor); captions,
formatted by the tokenizer's chat template (one user message, generation prompt added, thinking on: the pipeline's
enable_thinking=True) -> the Qwen3 text encoder's hidden states before its last layer (hidden_states[-2]), each
caption's own tokens only (the pipeline's prompt_masks select them: the transformer takes a list of caption states
of their own lengths); t uniform in [0, 1] (the script's default weighting_scheme none) or logit-normal, shifted
as the model's scheduler shifts its sigmas (s t / (1 + (s - 1) t); s = 3.0 for Z-Image-Turbo, 6.0 for Z-Image);
x_t = (1 - t) x0 + t eps; the single-stream transformer takes the list of latents (C, 1, h, w), the timestep 1 - t
(its t runs from noise, 0, to data, 1) and the caption list, and predicts x0 - eps: the pipeline and the script
negate its output to get the velocity eps - x0, the target; mean squared error. Validation is the rectified flow's
(rectified_flow.py): fixed timesteps k / N and fixed noise per sample id.

Captions of different lengths: a batch's ``text_embeds`` hold each caption's states first and zeros after (online and
precomputed alike), and a caption's length is its number of non-zero rows (a Qwen3 hidden state is never exactly
zero). ``objective.text_dropout`` zeroes a caption's states but keeps its length.

The trained part is diffusers' ZImageTransformer2DModel, the text encoder transformers' Qwen3Model (the pipeline's
class; no LM head). The VAE is FLUX.1's AutoencoderKL. The chat template and the caption length a folder's tokenizer
records are chat_text.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
from torch.nn.utils.rnn import pad_sequence
from transformers import Qwen3Model

from diffusion.batch import INPUT_IDS, LATENTS, TEXT_EMBEDS
from diffusion.errors import UsageError
from diffusion.models import rectified_flow
from diffusion.models.base import (
    NO_CUDNN_ATTENTION,
    Geometry,
    LatentDiffusion,
    LeadingImage,
    a_third_in,
    block_stack,
    checked_text_states,
    hw,
    vae_factor,
)
from diffusion.models.chat_text import ChatTemplateText, ChatText, qwen_length
from diffusion.models.flops import denoiser_flops
from diffusion.models.rectified_flow import TIMESTEPS, RectifiedFlow, RectifiedFlowSteps
from diffusion.settings import OneOf, Range, same_as, setting


@dataclass
class ZImageObjective:
    """A Z-Image run's loss options (the ``objective`` section of a recipe; a preset may set its own)."""

    timesteps: str = setting(
        "uniform",
        "training t: uniform in [0, 1] (diffusers' Z-Image script's default), or logit_normal (logit_mean, logit_std); "
        "then shifted (shift)",
        OneOf(TIMESTEPS),
    )
    logit_mean: float = same_as(RectifiedFlow, "logit_mean")
    logit_std: float = same_as(RectifiedFlow, "logit_std")
    shift: float = setting(
        3.0,
        "t -> s t / (1 + (s - 1) t), as the scheduler shifts its sigmas (default: the model's scheduler's shift, "
        "Z-Image-Turbo's 3.0, Z-Image's 6.0)",
        Range(gt=0),
    )
    text_dropout: float = same_as(RectifiedFlow, "text_dropout")
    max_sequence_length: int = same_as(ChatText, "max_sequence_length")
    pad_token_id: int = same_as(ChatText, "pad_token_id")
    val_timesteps: int = same_as(RectifiedFlow, "val_timesteps")


def image_tokens(x, *_, patch_size: int = 2, f_patch_size: int = 1, **__) -> int:
    """The image tokens that lead each sample's sequence in a ZImageTransformer2DModel call (its arguments): one
    image per sample (a list of (C, F, H, W) latents, the pipeline's and ours), all of one size (one bucket)."""
    sizes = {tuple(latent.shape) for latent in x} if all(isinstance(latent, torch.Tensor) for latent in x) else None
    if sizes is None or len(sizes) != 1:
        raise RuntimeError(f"token routing: Z-Image latents of one size, one per sample, were expected, not {sizes}")
    _, frames, height, width = sizes.pop()
    return (frames // f_patch_size) * (height // patch_size) * (width // patch_size)


class ZImage(ChatTemplateText, RectifiedFlowSteps, LatentDiffusion):
    NAME, DESCRIPTION = "z-image", "a Z-Image model"
    OBJECTIVE = ZImageObjective
    PIPELINE = "ZImagePipeline"
    PARTS = {"transformer": ZImageTransformer2DModel, "vae": AutoencoderKL, "text_encoder": Qwen3Model}
    TOKENIZERS = {"tokenizer": INPUT_IDS}
    SCHEDULER = FlowMatchEulerDiscreteScheduler
    FROZEN = ("vae", "text_encoder")
    SDPA_KERNELS = NO_CUDNN_ATTENTION
    LATENT_SHIFT = True  # ZImagePipeline decodes latents / scaling_factor + shift_factor
    THINKING = True  # ZImagePipeline formats captions with enable_thinking=True (Qwen3's template: no think block)

    @classmethod
    def sampling_options(cls, pipe, guidance_scale: float, count: int) -> dict:
        """ZImagePipeline's guidance adds w (cond - uncond) to cond, so w = scale - 1 (w = 0 is none)."""
        return {"guidance_scale": max(guidance_scale - 1, 0.0), "max_sequence_length": qwen_length(pipe.tokenizer)}

    # the embedders, the final layer (the pad tokens, (1, dim) parameters outside any module, go to Muon with the blocks)
    MUON_EXCLUDE = ("all_x_embedder", "cap_embedder", "t_embedder", "all_final_layer")
    LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")  # diffusers' train_dreambooth_lora_z_image.py's default
    LORA_TEXT_ENCODERS = ()  # ZImagePipeline.load_lora_weights reads the transformer's adapters only
    # the image refiner (its blocks see the image tokens), the caption refiner, then the main single-stream blocks
    BLOCKS = {
        "noise_refiner": ("noise_refiner", "n_refiner_layers"),
        "context_refiner": ("context_refiner", "n_refiner_layers"),
        "layers": ("layers", "n_layers"),
    }
    # token routing (routing.py) over the main blocks (the noise refiner's sequence is another one): each takes one
    # sequence per sample, the image's tokens first, with an attention mask and a rotary table per sample
    ROUTING = {"layers": ("layers", "n_layers")}
    ROUTING_LAYOUT = LeadingImage("x", ("attn_mask", "freqs_cis"), image_tokens)
    FP8_KEEP = ("adaLN_modulation.0",)

    @classmethod
    def alignable_blocks(cls, get):
        """REPA: the noise refiner's blocks and the main ones. diffusers 0.39's transformer (basic mode: one image per
        sample) puts each sample's image tokens first, its patches row by row, padded to a multiple of 32 with a
        learned pad token; the main blocks' sequence then has the caption (padded alike), then zeros up to the
        batch's longest: the image's tokens lead both, and only they are aligned (Block.image_first). Default: the
        block a third of the way in, as FLUX's."""
        width, p = get("dim"), cls.patch({"all_patch_size": get("all_patch_size")})
        refiner, main = get("n_refiner_layers"), get("n_layers")
        blocks = block_stack("noise_refiner", "noise_refiner", refiner, width, p, None, image_first=True)
        blocks.update(block_stack("layers", "layers", main, width, p, None, image_first=True))
        return blocks, a_third_in(blocks)

    def __init__(self, scheduler=None, **options):
        """The rectified flow's (rectified_flow.py: the parts, the objective, the scheduler), the shift a folder's own
        unless the run sets it."""
        super().__init__(scheduler, **options)
        if "shift" not in (options.get("objective") or {}) and scheduler is not None:  # Z-Image's 6.0, Turbo's 3.0
            self.objective["shift"] = float(scheduler.config.shift)

    # --- shapes -----------------------------------------------------------------------------------
    @staticmethod
    def patch(transformer_config) -> int:
        return (transformer_config.get("all_patch_size") or [2])[0]

    @staticmethod
    def geometry(configs: dict, resolution: int | None) -> Geometry:
        return Geometry(
            resolution=resolution or 1024,
            downsample_factor=vae_factor(configs["vae"]) * ZImage.patch(configs["transformer"]),
        )

    @staticmethod
    def denoiser_inputs(configs: dict) -> dict[str, dict[str, int]]:
        t = configs["transformer"]
        return {
            "vae": {"latent_channels": t.get("in_channels", 16)},
            "text_encoder": {"hidden_size": t.get("cap_feat_dim", 2560)},
        }

    @property
    def text_width(self) -> int:
        return self.transformer.config.cap_feat_dim

    @property
    def text_body(self) -> torch.nn.Module:
        return self.text_encoder  # Qwen3Model: the body itself

    # --- conditioning ----------------------------------------------------------------------------
    @torch.no_grad()
    def encode_latents(self, batch: dict, generator=None, posterior_noise=None) -> torch.Tensor:
        """(z - shift_factor) * scaling_factor of the posterior's mean (or of LATENTS as they are), as the LoRA script
        takes them; sides checked against the transformer's patches."""
        z = batch[LATENTS].float() if LATENTS in batch else self.posterior_moments(batch)[:, : self.latent_channels]
        p, (h, w) = self.patch(self.transformer.config), z.shape[-2:]
        if h % p or w % p:
            raise UsageError(
                f"latents of {h}x{w} cannot be cut into {p}x{p} patches; use an image size that is a multiple of "
                f"{p * self.vae_scale_factor}"
            )
        cfg = self.vae.config
        return (z - cfg.shift_factor) * cfg.scaling_factor

    def encode_text(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(the caption states (B, L, D), each caption's tokens first and zeros after; their lengths (B,)), checked
        against the transformer's caption width."""
        with torch.no_grad():
            if TEXT_EMBEDS in batch:
                seq = batch[TEXT_EMBEDS]
                lengths = (seq != 0).any(dim=-1).sum(dim=1)
            else:
                ids = self.checked_ids(batch)
                mask = ids != self.objective["pad_token_id"]
                states = self.text_encoder(
                    input_ids=ids, attention_mask=mask.long(), output_hidden_states=True, use_cache=False
                ).hidden_states[-2]
                kept = pad_sequence([s[m] for s, m in zip(states, mask)], batch_first=True)  # the pipeline's selection
                seq = torch.zeros_like(states)
                seq[:, : kept.shape[1]] = kept
                lengths = mask.sum(dim=1)
        width = self.text_width
        checked_text_states(seq, self.text_length, f"cap_feat_dim={width} (its Qwen3 encoder's width)", width)
        return seq, lengths.clamp(min=1)

    # --- objective -----------------------------------------------------------------------------------
    def _predict(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, seq: torch.Tensor, lengths):
        """(prediction, target) for clean latents x0, noise, timesteps t in [0, 1] and caption states with their
        lengths: the transformer takes the latents as a list of (C, 1, h, w), the timestep 1 - t and each caption's
        own states; its output negated is the velocity eps - x0 (the pipeline's and the script's sign)."""
        seq = seq.to(x0.dtype)
        x_t, velocity = rectified_flow.noised(x0, noise, t)
        out = self.transformer(
            list(x_t.unsqueeze(2).unbind(0)), 1 - t, [s[: int(n)] for s, n in zip(seq, lengths)], return_dict=False
        )[0]
        return -torch.stack(out).squeeze(2), velocity

    def image_tokens(self, x0: torch.Tensor) -> int:
        """The transformer's image tokens for latents ``x0`` (its patch_size patches), which shift=auto reads."""
        patch = self.patch(self.transformer.config)
        return (x0.shape[2] // patch) * (x0.shape[3] // patch)

    def pipeline(self, tokenizers: dict):
        return ZImagePipeline(
            scheduler=self.scheduler or FlowMatchEulerDiscreteScheduler(shift=self.objective["shift"]),
            vae=self.vae,
            text_encoder=self.text_encoder,
            tokenizer=self.pipeline_tokenizer(tokenizers),
            transformer=self.transformer,
        )

    # --- FLOPs ---------------------------------------------------------------------------------------
    def _denoiser_flops(self, image_size: int | tuple[int, int]) -> float:
        """One sample with a caption of max_sequence_length tokens (the transformer pads both to multiples of 32)."""
        cfg = self.transformer.config
        h, w = (side // self.vae_scale_factor for side in hw(image_size))
        return denoiser_flops(
            self,
            lambda: (
                [torch.randn(cfg.in_channels, 1, h, w)],
                torch.tensor([0.5]),
                [torch.randn(self.text_length, cfg.cap_feat_dim)],
            ),
            lambda: {"return_dict": False},
        )
