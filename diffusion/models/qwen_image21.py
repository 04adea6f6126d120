"""Qwen-Image 2.1 (Qwen, 2026) as a ComposerModel: the rules of diffusers 0.42's QwenImage21Pipeline and
QwenImage21Transformer2DModel, text-to-image.

One training step, top to bottom: images, made opaque RGBA (the pipeline converts every image to RGBA; its VAE reads
four channels) -> 64-channel latents of AutoencoderKLQwenImage21 (16x spatial compression; one frame), sampled from
the posterior and normalised per channel by its latents_mean and latents_std, as the pipeline undoes them before
decoding; captions put into the pipeline's raw template string (prompt_template_t2i: a system message, then the
caption as the user's, an empty caption read as " ") and tokenized as its processor tokenizes it, cut (never the
template's suffix) to the objective's length and padded after the suffix; Qwen3-VL's last decoder layer's output
before its final norm (the pipeline's forward hook on the norm), read with positions that count real tokens only (so
the padding's side does not matter: the pipeline pads on the left), the system message's tokens dropped
(``system_tokens``: the pipeline's _drop_idx), the padding zeroed and masked, the batch cut to its longest caption
(the pipeline pads a batch of prompts to its longest: the image's RoPE frame follows the text); t uniform in [0, 1]
(or logit-normal), shifted as the pipeline's scheduler shifts its sigmas (exp(mu), mu linear in the image tokens from
0.5 at 256 to 1.15 at 4096: calculate_shift on the scheduler's config); x_t = (1 - t) x0 + t eps, flattened into one
token per latent pixel (patch_size 1); the transformer takes [text, image] as one block-causal sequence (the text
causal, the image block bidirectional and seeing all the text; img_mask: one slot per 2x2 image tokens after the
text), t itself as its timestep (the pipeline's t / 1000), the text mask and img_shapes, and its output's image
tokens are the velocity eps - x0 the scheduler steps with; mean squared error. Validation is the rectified flow's
(rectified_flow.py).

The trained part is diffusers' QwenImage21Transformer2DModel, the text encoder Qwen3VLForConditionalGeneration (the
pipeline's; its vision tower and LM head unused), the pipeline's tokenizer a Qwen3VLProcessor (its folder
``processor``). Condition images (editing: their tokens substituted into the text stream) are not trained here: no
setting asks for them. The Turbo checkpoint has the same architecture and records its sampling grid
(model_index.json's sample_sigmas, kept as ``sample_sigmas`` and exported again).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any

import torch
from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline
from diffusers import QwenImage21Transformer2DModel as Transformer
from transformers import BatchEncoding, Qwen3VLForConditionalGeneration

from diffusion.batch import INPUT_IDS
from diffusion.errors import UsageError
from diffusion.models import rectified_flow
from diffusion.models.base import NO_CUDNN_ATTENTION, Geometry, LatentDiffusion, hw
from diffusion.models.chat_text import ChatCaptions, ChatTemplateText, ChatText, ProcessorTokenizer
from diffusion.models.flops import denoiser_flops, encode_flops
from diffusion.models.presets.qwen_image21 import QWEN_IMAGE_21_SCHEDULER
from diffusion.models.qwen_vae import QwenImageLatents, qwen_vae_factor
from diffusion.models.rectified_flow import RectifiedFlow, RectifiedFlowSteps, scheduler_line
from diffusion.models.tokenizer import padded_to
from diffusion.settings import Each, Either, Range, same_as, setting

# QwenImage21Pipeline's text-to-image template (its prompt_template_t2i, set in its __init__ from sys_prompt;
# tests/test_qwen_image21.py checks it against the pipeline's), cut at the caption
SYSTEM_PROMPT = "Comprehend and analyze the provided prompt."
PREFIX = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n"
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
SLOT = 4  # image tokens per slot of the transformer's img_mask (a 2x2 group: its _IMG_TOKENS_PER_SLOT)


@dataclass
class QwenImage21Objective:
    """A Qwen-Image 2.1 run's loss options (the ``objective`` section of a recipe; a preset may set its own)."""

    timesteps: str = same_as(RectifiedFlow, "timesteps")
    logit_mean: float = same_as(RectifiedFlow, "logit_mean")
    logit_std: float = same_as(RectifiedFlow, "logit_std")
    shift: Any = setting(
        "auto",
        "t -> s t / (1 + (s - 1) t); auto: s = exp(mu(image tokens)) as QwenImage21Pipeline's scheduler shifts its "
        "sigmas",
        Either(Range(gt=0), ("auto",)),
    )
    base_seq_len: int = same_as(RectifiedFlow, "base_seq_len")
    max_seq_len: int = same_as(RectifiedFlow, "max_seq_len")
    base_shift: float = same_as(RectifiedFlow, "base_shift")
    max_shift: float = same_as(RectifiedFlow, "max_shift")
    text_dropout: float = same_as(RectifiedFlow, "text_dropout")
    max_sequence_length: int = setting(
        512,
        "Qwen3-VL states per caption after the dropped system message, the template's suffix included (longer "
        "captions are cut; from a pipeline folder: its tokenizer's model_max_length when at most 8192)",
        Range(gt=8, integer=True),
    )
    pad_token_id: int = same_as(ChatText, "pad_token_id")
    system_tokens: int = setting(
        12,
        "the template's system-message tokens whose states are dropped (QwenImage21Pipeline's _drop_idx; from a "
        "folder: counted from its processor as the pipeline counts them)",
        Range(gt=0, integer=True),
    )
    sample_sigmas: tuple = setting(
        (),
        "the sampling grid an exported pipeline records (the Turbo checkpoint's sample_sigmas; from a folder: its "
        "model_index.json's); empty: the pipeline's own",
        Each(Range(gt=0, le=1)),
        shown="none",
    )
    val_timesteps: int = same_as(RectifiedFlow, "val_timesteps")


def system_tokens(processor) -> int:
    """The tokens of the template's system message, counted as QwenImage21Pipeline.__init__ counts its _drop_idx."""
    message = [{"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPT}]}]
    return len(processor.apply_chat_template(message, tokenize=True, return_dict=False)[0])


class QwenImage21Captions(ChatCaptions):
    """A tokenizer that lays each caption out as QwenImage21Pipeline's processor tokenizes it (the template's prefix,
    the caption, the suffix), cut before the suffix to fit ``max_length`` and padded after it (``processor``: the
    pipeline's; everything else is its tokenizer's)."""

    def __init__(self, processor):
        super().__init__(processor.tokenizer)
        self.processor = processor

    def format(self, text: str) -> str:
        return PREFIX + (text or " ") + SUFFIX  # the pipeline reads an empty caption as " "

    def __call__(self, text, max_length=None, return_tensors=None, **_):
        texts = [text] if isinstance(text, str) else list(text)
        length = max_length or self.tokenizer.model_max_length
        tail = self.tokenizer(SUFFIX).input_ids
        rows = []
        for caption in texts:
            body = self.tokenizer(PREFIX + (caption or " "), truncation=True, max_length=length - len(tail)).input_ids
            rows.append(body + tail)
        pad = self.tokenizer.pad_token_id
        encoded = {
            "input_ids": [row + [pad] * (length - len(row)) for row in rows],
            "attention_mask": [[1] * len(row) + [0] * (length - len(row)) for row in rows],
        }
        if return_tensors == "pt":
            encoded = {key: torch.tensor(value) for key, value in encoded.items()}
        elif isinstance(text, str):
            encoded = {key: value[0] for key, value in encoded.items()}
        return BatchEncoding(encoded)


def rgba(images: torch.Tensor) -> torch.Tensor:
    """RGB images in [-1, 1] made opaque RGBA, as the pipeline's convert("RGBA") and its image processor give them."""
    return torch.cat([images, images.new_ones(images.shape[0], 1, *images.shape[2:])], dim=1)


@contextlib.contextmanager
def before_final_norm(body: torch.nn.Module):
    """The language model's last hidden states before its final RMSNorm, as QwenImage21Pipeline reads them (its forward
    hook on the norm returns the norm's input: transformers 5 ties hidden_states[-1] to the normed output)."""
    handle = body.norm.register_forward_hook(lambda module, args, output: args[0])
    try:
        yield
    finally:
        handle.remove()


def masks_on_meta(transformer: torch.nn.Module) -> list:
    """A count on the meta device (FLOP tracing, step_memory): the transformer lays its sequence out from img_mask in
    Python (block lengths, RoPE positions, attention segments), so the count gives img_mask on the CPU; the
    target-token mask it derives from it is moved to the meta device where the blocks and the final norm select their
    modulation rows with it. The hooks' handles."""

    def on_meta(module, args, kwargs):
        if kwargs.get("target_token_mask") is not None:
            kwargs["target_token_mask"] = kwargs["target_token_mask"].to("meta")
        args = tuple(a.to("meta") if isinstance(a, torch.Tensor) and a.dtype == torch.bool else a for a in args)
        return args, kwargs

    modules = (*transformer.transformer_blocks, transformer.norm_out)
    handles = [module.register_forward_pre_hook(on_meta, with_kwargs=True) for module in modules]
    repeats = MetaRepeats()

    def enter(module, args) -> None:
        repeats.__enter__()

    def leave(module, args, output) -> None:
        repeats.__exit__(None, None, None)

    handles.append(transformer.register_forward_pre_hook(enter))
    handles.append(transformer.register_forward_hook(leave))
    return handles


class MetaRepeats(torch.overrides.TorchFunctionMode):
    """The transformer's forward on the meta device repeats its joint sequence by counts it computes on the CPU (from
    img_mask); torch 2.15's backward of that repeat_interleave adds into the meta gradient at those CPU indices and
    refuses the mix (torch 2.7's did not check). Under this mode a meta tensor is repeated by the counts moved to the
    meta device, the output's length given from them, so the backward's indices are meta too."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave) and len(args) > 1:
            x, counts = args[0], args[1]
            if x.is_meta and isinstance(counts, torch.Tensor) and not counts.is_meta:
                args, kwargs = (x, counts.to("meta"), *args[2:]), {**kwargs, "output_size": int(counts.sum())}
        return func(*args, **kwargs)


@contextlib.contextmanager
def counted_on_meta(transformer: torch.nn.Module, meta: bool):
    """masks_on_meta for the duration where the step runs on the meta device (nothing otherwise); the device img_mask
    is made on."""
    handles = masks_on_meta(transformer) if meta else []
    try:
        yield torch.device("cpu") if meta else None
    finally:
        for handle in handles:
            handle.remove()


class QwenImage21(QwenImageLatents, ProcessorTokenizer, ChatTemplateText, RectifiedFlowSteps, LatentDiffusion):
    NAME, DESCRIPTION = "qwen-image-21", "a Qwen-Image 2.1 model"
    OBJECTIVE = QwenImage21Objective
    PIPELINE = "QwenImage21Pipeline"
    PARTS = {
        "transformer": Transformer,
        "vae": AutoencoderKLQwenImage21,
        "text_encoder": Qwen3VLForConditionalGeneration,
    }
    TOKENIZERS = {"processor": INPUT_IDS}
    SCHEDULER = FlowMatchEulerDiscreteScheduler
    FROZEN = ("vae", "text_encoder")
    SDPA_KERNELS = NO_CUDNN_ATTENTION
    # the embedders, the shared modulation and the final layer
    MUON_EXCLUDE = ("img_in", "txt_in", "time_text_embed", "modulation", "norm_out", "proj_out")
    # every block's attention projections (text and image tokens share them): the keys QwenImageLoraLoaderMixin reads
    LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
    LORA_TEXT_ENCODERS = ()  # QwenImage21Pipeline.load_lora_weights reads the transformer's adapters only
    FP8_KEEP = ()  # the modulation is outside the blocks, shared by all of them
    BLOCKS = {"blocks": ("transformer_blocks", "num_layers")}

    @classmethod
    def sampling_options(cls, pipe, guidance_scale: float, count: int) -> dict:
        """The pipeline's true classifier-free guidance against the empty caption (none at 1: its default, Qwen's
        recommendation); it pads captions to the batch's longest itself."""
        return {"true_cfg_scale": guidance_scale} | ({"negative_prompt": [""] * count} if guidance_scale > 1 else {})

    @classmethod
    def folder_objective(cls, tokenizers: dict) -> dict:
        """The caption length and padding id of the folder's processor's tokenizer, and its system message's tokens."""
        processor = tokenizers.get(INPUT_IDS)
        implied = super().folder_objective(tokenizers)
        return implied if processor is None else implied | {"system_tokens": system_tokens(processor)}

    @classmethod
    def pipeline_objective(cls, index: dict) -> dict:
        """The sampling grid a folder's pipeline records (the Turbo checkpoint's sample_sigmas)."""
        return {"sample_sigmas": tuple(index.get("sample_sigmas") or ())}

    @classmethod
    def caption_tokenizers(cls, tokenizers: dict) -> dict:
        return {key: QwenImage21Captions(processor) for key, processor in tokenizers.items()}

    def __init__(self, scheduler=None, **options):
        """The rectified flow's (rectified_flow.py: the parts, the objective, the scheduler), the shift's line the
        scheduler's unless the run sets it (the pipeline computes mu from its config)."""
        super().__init__(scheduler, **options)
        scheduler_line(self.objective, scheduler, options.get("objective") or {})

    # --- shapes -----------------------------------------------------------------------------------
    @staticmethod
    def geometry(configs: dict, resolution: int | None) -> Geometry:
        """A folder's native size is the pipeline's output_resolution (1024 px); sides are multiples of twice the
        VAE's factor (the pipeline's multiple_of: whole 2x2 slots of latent pixels)."""
        vae = {"temperal_downsample": [False, True, True, True], **configs["vae"]}
        return Geometry(resolution=resolution or 1024, downsample_factor=qwen_vae_factor(vae) * 2)

    @staticmethod
    def denoiser_inputs(configs: dict) -> dict[str, dict[str, int]]:
        """The VAE (its latent channels) and the Qwen3-VL text encoder (its width, in text_config) can be swapped."""
        t = configs["transformer"]
        return {
            "vae": {"z_dim": t.get("in_channels", 64)},
            "text_encoder": {"text_config.hidden_size": t.get("context_in_dim", 4096)},
        }

    @property
    def token_length(self) -> int:
        """Token ids per caption: the dropped system message, then the states kept (the suffix's among them)."""
        return self.objective["system_tokens"] + self.text_length

    @property
    def text_width(self) -> int:
        return self.transformer.config.context_in_dim

    @staticmethod
    def text_width_source(width: int) -> str:
        return "the width of Qwen3-VL's states"

    @property
    def text_body(self) -> torch.nn.Module:
        """Qwen3-VL's language model, whose states are read (its vision tower and LM head never run)."""
        return self.text_encoder.model.language_model

    # --- conditioning ----------------------------------------------------------------------------
    def latent_moments(self, images: torch.Tensor) -> torch.Tensor:
        """The posterior's moments of the images made opaque RGBA (rgba)."""
        return super().latent_moments(rgba(images))

    def text_states(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The last layer's states before the final norm after the system message (B, L, D), the padding's zeroed;
        positions count real tokens only (QwenImage21Pipeline._get_qwen_prompt_embeds)."""
        positions = (mask.long().cumsum(dim=-1) - 1).clamp(min=0).unsqueeze(0).expand(3, -1, -1)
        with before_final_norm(self.text_body):
            out = self.text_encoder.model(
                input_ids=ids, attention_mask=mask, position_ids=positions, output_hidden_states=True, use_cache=False
            )
        drop = self.objective["system_tokens"]
        states = out.hidden_states[-1][:, drop:]
        return states * mask[:, drop:, None].to(states.dtype)

    @staticmethod
    def text_mask(seq: torch.Tensor) -> torch.Tensor:
        """The pipeline's prompt_embeds_mask: the tokens whose states are not the zeros the padding is stored as; a
        caption dropped whole (text_dropout's zeros) keeps every token (never a causal text row with no key)."""
        mask = seq.ne(0).any(dim=-1)
        return mask | ~mask.any(dim=1, keepdim=True)

    @staticmethod
    def longest_caption(seq: torch.Tensor) -> torch.Tensor:
        """The states cut to the batch's longest caption (at least one token), as the pipeline pads a batch."""
        length = int(seq.ne(0).any(dim=-1).sum(dim=1).max())
        return seq[:, : max(length, 1)]

    # --- objective -----------------------------------------------------------------------------------
    def _predict(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, seq: torch.Tensor, pooled=None):
        """(prediction, target) as (B, h w, C) tokens for clean latents x0 (B, C, h, w), noise and timesteps t in
        [0, 1]; the text states enter in the latents' dtype, cut to the batch's longest caption."""
        n, c, h, w = x0.shape
        if h % 2 or w % 2:
            raise UsageError(
                f"latents of {h}x{w} do not fill the transformer's 2x2 image slots; use an image size that is a "
                f"multiple of {2 * self.vae_scale_factor}"
            )
        seq = self.longest_caption(seq).to(x0.dtype)
        x_t, velocity = rectified_flow.noised(x0, noise, t)
        with counted_on_meta(self.transformer, x0.is_meta) as layout:
            slots = torch.ones(n, h * w // SLOT, dtype=torch.bool, device=layout or x0.device)
            text = torch.zeros(n, seq.shape[1], dtype=torch.bool, device=layout or x0.device)
            pred = self.transformer(
                hidden_states=QwenImage21Pipeline._pack_latents(x_t, n, c, h, w),
                encoder_hidden_states=seq,
                timestep=t.to(x0.dtype),
                img_shapes=[[(1, h, w)]] * n,
                img_mask=torch.cat([text, slots], dim=1),
                encoder_hidden_states_mask=self.text_mask(seq),
            ).sample[:, -h * w :]
        return pred, QwenImage21Pipeline._pack_latents(velocity, n, c, h, w)

    def image_tokens(self, x0: torch.Tensor) -> int:
        """The transformer's image tokens for latents ``x0`` (one per latent pixel), which shift=auto reads."""
        return x0.shape[2] * x0.shape[3]

    def pipeline_tokenizer(self, tokenizers: dict):
        """The processor as the pipeline takes it (it formats captions itself), its tokenizer recording this run's
        caption length (qwen_length reads it back from an export)."""
        tok = tokenizers[INPUT_IDS]
        processor = copy.copy(tok.processor if isinstance(tok, QwenImage21Captions) else tok)
        processor.tokenizer = padded_to(processor.tokenizer, self.text_length)
        return processor

    def pipeline(self, tokenizers: dict):
        return QwenImage21Pipeline(
            scheduler=self.scheduler or FlowMatchEulerDiscreteScheduler.from_config(QWEN_IMAGE_21_SCHEDULER),
            vae=self.vae,
            text_encoder=self.text_encoder,
            processor=self.pipeline_tokenizer(tokenizers),
            transformer=self.transformer,
            sample_sigmas=list(self.objective["sample_sigmas"]) or None,
        )

    # --- FLOPs ---------------------------------------------------------------------------------------
    def prepare_traced(self, denoiser: torch.nn.Module) -> None:
        super().prepare_traced(denoiser)
        masks_on_meta(denoiser)

    def _denoiser_flops(self, image_size: int | tuple[int, int]) -> float:
        """One sample with a caption of max_sequence_length tokens, masked as a padded one is."""
        cfg = self.transformer.config
        h, w = (side // self.vae_scale_factor for side in hw(image_size))
        length = self.text_length
        slots = torch.ones(1, h * w // SLOT, dtype=torch.bool, device="cpu")  # img_mask on the CPU: masks_on_meta
        return denoiser_flops(
            self,
            lambda: (
                torch.randn(1, h * w, cfg.in_channels),
                torch.randn(1, length, cfg.context_in_dim),
                torch.tensor([0.5]),
                [[(1, h, w)]],
                torch.cat([torch.zeros(1, length, dtype=torch.bool, device="cpu"), slots], dim=1),
                torch.ones(1, length, dtype=torch.bool),
            ),
        )

    def _encoder_flops(self, image_size: int | tuple[int, int]) -> float:
        """The VAE's encoder on one RGBA frame and the text body over a caption."""
        return encode_flops(self.vae, (4, 1, *hw(image_size))) + self.text_body_flops()
