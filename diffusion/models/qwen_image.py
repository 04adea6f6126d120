"""Qwen-Image as a ComposerModel: the rules of diffusers 0.39's QwenImagePipeline and its LoRA training script
(examples/dreambooth/train_dreambooth_lora_qwen_image.py).

One training step, top to bottom: images -> 16-channel latents of Qwen-Image's VAE (AutoencoderKLQwenImage, a causal
3D VAE fed one frame), sampled from the posterior (as the script does; or from precomputed moments), normalised per
channel by the VAE's latents_mean and latents_std; captions, put into the pipeline's prompt template (a system prompt
describing the image, then the caption as the user's message) -> the last hidden states of Qwen2.5-VL's language
model (the states of the template's first 34 tokens, its system prompt, dropped; padding zeroed and masked as the
pipeline zeroes and masks it); timestep t uniform in [0, 1] (the script's default weighting_scheme none; or
logit-normal), shifted by 3.0 as the script's scheduler shifts its sigmas; x_t = (1 - t) x0 + t eps, packed 2x2 into
tokens; the transformer (60 dual-stream blocks, RoPE over the image's (frame, height, width) and the text) takes t
itself as its timestep, the text mask, and img_shapes; it predicts the velocity eps - x0; mean squared error.
Validation is the rectified flow's (rectified_flow.py): fixed timesteps k / N and fixed noise per sample id; the
chat-template text path (the caption length a folder's tokenizer records, the padding mask) is chat_text.py's, the VAE's
latents qwen_vae.py's (Krea 2 takes them too).

The trained part is diffusers' QwenImageTransformer2DModel; the text encoder Qwen2_5_VLForConditionalGeneration, as the
pipeline holds it (its vision tower and LM head unused: the states are read from its body).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0
from transformers import Qwen2_5_VLForConditionalGeneration

from diffusion.batch import INPUT_IDS
from diffusion.errors import UsageError
from diffusion.models import rectified_flow
from diffusion.models.base import NO_CUDNN_ATTENTION, Geometry, LatentDiffusion, a_third_in, block_stack, hw, true_cfg
from diffusion.models.chat_text import ChatCaptions, ChatTemplateText, ChatText, qwen_length
from diffusion.models.flops import denoiser_flops
from diffusion.models.per_sample_rope import PerSampleRopeQwen
from diffusion.models.presets.qwen_image import QWEN_IMAGE_SCHEDULER
from diffusion.models.qwen_vae import QwenImageLatents, qwen_vae_factor
from diffusion.models.rectified_flow import TIMESTEPS, RectifiedFlow, RectifiedFlowSteps
from diffusion.settings import Either, OneOf, Range, same_as, setting

# QwenImagePipeline's prompt template and the number of its first tokens whose states it drops (set in its __init__;
# tests/test_qwen_image.py checks them against the pipeline's)
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
DROP = 34  # prompt_template_encode_start_idx
PIPELINE_MAX_LENGTH = 1024  # the pipeline refuses a max_sequence_length above it


@dataclass
class QwenImageObjective:
    """A Qwen-Image run's loss options (the ``objective`` section of a recipe; a preset may set its own): FLUX.2's,
    with the script's shift 3.0, no guidance embedding, and captions of up to the pipeline's 1024 tokens."""

    timesteps: str = setting(
        "uniform",
        "training t: uniform in [0, 1] (the script's default weighting_scheme none), or logit_normal (logit_mean, "
        "logit_std); then shifted (shift)",
        OneOf(TIMESTEPS),
    )
    logit_mean: float = same_as(RectifiedFlow, "logit_mean")
    logit_std: float = same_as(RectifiedFlow, "logit_std")
    shift: Any = setting(
        3.0,
        "t -> s t / (1 + (s - 1) t), as the script's scheduler (shift=3.0) shifts its sigmas; auto: s = exp(mu(image "
        "tokens)) as in FLUX.1",
        Either(Range(gt=0), ("auto",)),
    )
    base_seq_len: int = same_as(RectifiedFlow, "base_seq_len")
    max_seq_len: int = same_as(RectifiedFlow, "max_seq_len")
    base_shift: float = same_as(RectifiedFlow, "base_shift")
    max_shift: float = same_as(RectifiedFlow, "max_shift")
    text_dropout: float = same_as(RectifiedFlow, "text_dropout")
    max_sequence_length: int = setting(
        512,
        f"Qwen2.5-VL states per caption after the template's {DROP} dropped tokens (the pipeline's default; from a "
        f"pipeline folder: its tokenizer's model_max_length when at most 8192, then at most {PIPELINE_MAX_LENGTH})",
        Range(gt=0, le=PIPELINE_MAX_LENGTH, integer=True),
    )
    pad_token_id: int = same_as(ChatText, "pad_token_id")
    val_timesteps: int = same_as(RectifiedFlow, "val_timesteps")


class TemplateCaptions(ChatCaptions):
    """A tokenizer that puts each caption into QwenImagePipeline's prompt template before tokenizing it."""

    def format(self, text: str) -> str:
        return PROMPT_TEMPLATE.format(text)


class QwenImage(QwenImageLatents, ChatTemplateText, RectifiedFlowSteps, LatentDiffusion):
    NAME, DESCRIPTION = "qwen-image", "a Qwen-Image model"
    OBJECTIVE = QwenImageObjective
    PIPELINE = "QwenImagePipeline"
    PARTS = {
        "transformer": QwenImageTransformer2DModel,
        "vae": AutoencoderKLQwenImage,
        "text_encoder": Qwen2_5_VLForConditionalGeneration,
    }
    TOKENIZERS = {"tokenizer": INPUT_IDS}
    SCHEDULER = FlowMatchEulerDiscreteScheduler
    FROZEN = ("vae", "text_encoder")
    SDPA_KERNELS = NO_CUDNN_ATTENTION
    MUON_EXCLUDE = ("img_in", "txt_in", "txt_norm", "time_text_embed", "norm_out", "proj_out")
    # both streams' attention projections, as SD3's and FLUX's defaults (their diffusers scripts'); diffusers'
    # train_dreambooth_lora_qwen_image.py adapts the image stream's alone (to_q, to_k, to_v, to_out.0), whose text keys
    # and values then stay the frozen model's: on the digits' new-signs proof 71.2% against 98.8% (docs/lora.md)
    LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    LORA_TEXT_ENCODERS = ()  # QwenImagePipeline.load_lora_weights reads the transformer's adapters only

    @classmethod
    def sampling_options(cls, pipe, guidance_scale: float, count: int) -> dict:
        """diffusers' true classifier-free guidance against the empty caption, at the caption length a run from the
        folder trains with (the pipeline takes at most 1,024)."""
        return true_cfg(min(qwen_length(pipe.tokenizer), 1024), guidance_scale, count)

    FP8_KEEP = ("img_mod.1", "txt_mod.1")
    # the dual-stream blocks, which token routing spans (joint.N; routing.py: their text mask and (image, text) RoPE
    # tables, and zero_cond_t's modulate_index, per kept token)
    BLOCKS = ROUTING = {"joint": ("transformer_blocks", "num_layers")}
    ROUTING_ATTENTION = {QwenDoubleStreamAttnProcessor2_0: PerSampleRopeQwen}

    @classmethod
    def alignable_blocks(cls, get):
        """REPA: every dual-stream block (the image stream is its second output); by default the one a third of the
        way in."""
        width = get("num_attention_heads") * get("attention_head_dim")
        blocks = block_stack("joint", "transformer_blocks", get("num_layers"), width, get("patch_size"))
        return blocks, a_third_in(blocks)

    def __init__(self, scheduler=None, **options):
        """The rectified flow's (rectified_flow.py: the parts, the objective, the scheduler); then the last block's
        unused text tail frozen."""
        super().__init__(scheduler, **options)
        # the last block's text stream after its attention (its output projection and MLP) reaches no output: frozen,
        # as no gradient reaches it (an optimizer state missing for it would fail a resume; DDP would wait for it)
        last = self.transformer.transformer_blocks[-1]
        for unused in (last.attn.to_add_out, last.txt_mlp):
            unused.requires_grad_(False)

    @classmethod
    def folder_objective(cls, tokenizers: dict) -> dict:
        """The chat template's (its tokenizer's caption length and padding id), the length at most the pipeline's 1024."""
        implied = super().folder_objective(tokenizers)
        if "max_sequence_length" in implied:
            implied["max_sequence_length"] = min(implied["max_sequence_length"], PIPELINE_MAX_LENGTH)
        return implied

    @classmethod
    def caption_tokenizers(cls, tokenizers: dict) -> dict:
        return {key: TemplateCaptions(tok) for key, tok in tokenizers.items()}

    # --- shapes -----------------------------------------------------------------------------------
    @staticmethod
    def geometry(configs: dict, resolution: int | None) -> Geometry:
        """A folder's native size is the pipeline's default one (1024 px); sides are whole 2x2 patches of latents."""
        f = qwen_vae_factor(configs["vae"]) * configs["transformer"].get("patch_size", 2)
        return Geometry(resolution=resolution or 1024, downsample_factor=f)

    @staticmethod
    def denoiser_inputs(configs: dict) -> dict[str, dict[str, int]]:
        """The VAE (its latent channels) and the Qwen2.5-VL text encoder (its width, which its config.json keeps in
        text_config) can be swapped."""
        t = configs["transformer"]
        return {
            "vae": {"z_dim": t.get("in_channels", 64) // t.get("patch_size", 2) ** 2},
            "text_encoder": {"text_config.hidden_size": t.get("joint_attention_dim", 3584)},
        }

    @property
    def token_length(self) -> int:
        """Token ids per caption: the template's dropped prefix, then the states kept."""
        return DROP + self.text_length

    # --- conditioning ----------------------------------------------------------------------------
    def text_states(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The last hidden states after the template's prefix (B, L, D), padding zeroed, as
        QwenImagePipeline._get_qwen_prompt_embeds makes them (its mask: text_mask)."""
        out = self.text_encoder.model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
        states = out.hidden_states[-1][:, DROP:]
        return states * mask[:, DROP:, None].to(states.dtype)  # the pipeline pads with zeros

    @staticmethod
    def text_width_source(width: int) -> str:
        return "the width of Qwen2.5-VL's states"

    @property
    def text_body(self) -> torch.nn.Module:
        """Qwen2.5-VL's language model, whose last states are the text states (its vision tower and LM head never run)."""
        return self.text_encoder.model.language_model

    # --- objective -----------------------------------------------------------------------------------
    @staticmethod
    def text_mask(seq: torch.Tensor) -> torch.Tensor | None:
        """The pipeline's prompt_embeds_mask: the tokens whose states are not the zeros it pads with (None when
        every token counts, as the pipeline passes it)."""
        mask = seq.ne(0).any(dim=-1)
        return None if bool(mask.all()) else mask.long()

    def _predict(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, seq: torch.Tensor, pooled=None):
        """Packed (prediction, target) for clean latents x0 (B, C, h, w), noise and timesteps t in [0, 1]; the text
        states enter in the latents' dtype (see flux.py)."""
        seq = seq.to(x0.dtype)
        n, c, h, w = x0.shape
        if h % 2 or w % 2:
            raise UsageError(
                f"latents of {h}x{w} cannot be packed into 2x2 patches; use an image size that is a multiple of "
                f"{2 * self.vae_scale_factor}"
            )
        x_t, velocity = rectified_flow.noised(x0, noise, t)
        pred = self.transformer(
            hidden_states=QwenImagePipeline._pack_latents(x_t, n, c, h, w),
            encoder_hidden_states=seq,
            encoder_hidden_states_mask=self.text_mask(seq),
            timestep=t,
            img_shapes=[[(1, h // 2, w // 2)]] * n,
        ).sample
        return pred, QwenImagePipeline._pack_latents(velocity, n, c, h, w)

    def image_tokens(self, x0: torch.Tensor) -> int:
        """The transformer's image tokens for latents ``x0`` (2x2 patches), which shift=auto reads."""
        return (x0.shape[2] // 2) * (x0.shape[3] // 2)

    def pipeline(self, tokenizers: dict):
        return QwenImagePipeline(
            scheduler=self.scheduler or FlowMatchEulerDiscreteScheduler.from_config(QWEN_IMAGE_SCHEDULER),
            vae=self.vae,
            text_encoder=self.text_encoder,
            tokenizer=self.pipeline_tokenizer(tokenizers),
            transformer=self.transformer,
        )

    # --- FLOPs ---------------------------------------------------------------------------------------
    def _denoiser_flops(self, image_size: int | tuple[int, int]) -> float:
        cfg = self.transformer.config
        h, w = (side // self.vae_scale_factor // 2 for side in hw(image_size))
        return denoiser_flops(
            self,
            lambda: (
                torch.randn(1, h * w, cfg.in_channels),
                torch.randn(1, self.text_length, cfg.joint_attention_dim),
                None,
                torch.tensor([0.5]),
                [[(1, h, w)]],
            ),
        )
