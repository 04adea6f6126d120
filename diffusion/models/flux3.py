"""FLUX.3 as a ComposerModel: the rules of diffusers 0.42.1's Flux3Transformer2DModel
(models/transformers/transformer_flux3.py) and its modular pipeline (modular_pipelines/flux3/).

One training step, top to bottom: images -> 32-channel AutoencoderKLFlux2 latents, the posterior's mean (the mode, as
Flux3VaeEncoderStep takes it; or precomputed moments), patchified 2x2 into 128 channels and normalised by the VAE's
batch-norm running statistics (FLUX.2 [klein]'s latents, flux2.py); captions, formatted by the processor's chat
template (one user message, generation prompt added) and right-padded -> the Qwen3-VL language model's hidden states
after layers 4, 8, ..., 32 (Flux3TextEncoderStep's text_encoder_out_layers), stacked along the width (8 x 2560 =
20480), the padding masked inside Qwen3-VL with its position ids set to 1 (the pipeline passes them so); each
caption's text window is its token count rounded up to a multiple of 80 (pad_multiple) and capped at
max_sequence_length, the states after it zero; t uniform in [0, 1] (or logit-normal), shifted as the sampler shifts
its sigmas (s t / (1 + (s - 1) t), s = 6.93: Flux3SetTimestepsStep); x_t = (1 - t) x0 + t eps; latents packed into
tokens row by row (Flux3PrepareLatentsStep: flatten, no further patching) with (t, h, w, l) position ids whose h and
w are scaled by 0.5 (image_rope_scale), the text's (0, 0, 0, l); the transformer takes t itself as its timestep
(Flux3LoopDenoiser: the scheduler's timestep / 1000) and predicts the velocity eps - x0, which the Euler scheduler
steps with; mean squared error. Validation is the rectified flow's (rectified_flow.py).

The transformer attends to every text token it is given (it takes no text mask): a batch takes its longest caption's
window, and a shorter caption's rows past its own window are zeros. The step-distilled model (family
"flux3-distilled", Flux3DistilledModularPipeline) is a flow map: it also takes the timestep each step jumps to
(Flux3DistilledLoopDenoiser: the next scheduler timestep); it trains at t - objective.flow_map_step (0: t itself,
the flow map's instantaneous velocity), the target still eps - x0, the straight path's velocity over any jump.

The text encoder is transformers' Qwen3VLForConditionalGeneration (its vision tower and LM head never run: the states
are read from its language model); the pipeline's tokenizer is a Qwen3VLProcessor (a folder's ``tokenizer``), built
around the offline chat tokenizer for a preset (``processor``). The pipeline is the modular one, its prompt upsampler
removed (captions are encoded as given, as training reads them); it samples one prompt per call.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import diffusers
import torch
from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux3Transformer2DModel
from diffusers.modular_pipelines.flux3.before_denoise import Flux3TextRoPEInputsStep, _prepare_image_ids
from transformers import Qwen3VLForConditionalGeneration, Qwen3VLProcessor

from diffusion.batch import INPUT_IDS
from diffusion.errors import UsageError, spell
from diffusion.models import rectified_flow
from diffusion.models.base import NO_CUDNN_ATTENTION, LatentDiffusion, a_third_in, block_stack
from diffusion.models.chat_text import ChatCaptions, ChatTemplateText, ChatText, qwen_length
from diffusion.models.flops import denoiser_flops
from diffusion.models.flux2 import Flux2, packed_inputs
from diffusion.models.presets.flux3 import FLUX3_SCHEDULER
from diffusion.models.rectified_flow import RectifiedFlow, RectifiedFlowSteps
from diffusion.settings import Range, same_as, setting

TEXT_LAYERS = (4, 8, 12, 16, 20, 24, 28, 32)  # Flux3TextEncoderStep's text_encoder_out_layers
PAD_MULTIPLE = 80  # Flux3TextEncoderStep(pad_multiple=80): a caption's window is a multiple of it
IMAGE_ROPE_SCALE = 0.5  # Flux3PrepareLatentsStep(image_rope_scale=0.5): the image's h and w position ids scaled so
SHIFT = 6.93  # Flux3SetTimestepsStep(shift=6.93): the sampler's constant timestep shift
# the reference-image mode (image-to-image conditioning), which text-to-image training never runs: held frozen, as no
# gradient reaches it (an optimizer, and a sharded checkpoint's state of it, would hold weights that never step)
IDLE = (
    "x_embedders.image_cond", "early_stream_modulations.image_cond", "single_stream_modulations.image_cond",
    "mode_blocks.image_cond",
)  # fmt: skip


@dataclass
class Flux3Objective:
    """A FLUX.3 run's loss options (the ``objective`` section of a recipe; a preset may set its own)."""

    timesteps: str = same_as(RectifiedFlow, "timesteps")
    logit_mean: float = same_as(RectifiedFlow, "logit_mean")
    logit_std: float = same_as(RectifiedFlow, "logit_std")
    shift: float = setting(
        SHIFT,
        "t -> s t / (1 + (s - 1) t), as the sampler shifts its sigmas (Flux3SetTimestepsStep's 6.93)",
        Range(gt=0),
    )
    text_dropout: float = same_as(RectifiedFlow, "text_dropout")
    max_sequence_length: int = same_as(ChatText, "max_sequence_length")
    pad_token_id: int = same_as(ChatText, "pad_token_id")
    flow_map_step: float = setting(
        0.0,
        "step-distilled (flow-map) models only: the transformer's target_timestep is t - flow_map_step, at least 0 "
        "(0: t itself; 1/16: the distilled pipeline's 16 steps)",
        Range(ge=0, lt=1),
    )
    val_timesteps: int = same_as(RectifiedFlow, "val_timesteps")


def processor(tokenizer) -> Qwen3VLProcessor:
    """The pipeline's tokenizer: a Qwen3VLProcessor as a folder holds it, else one around ``tokenizer`` (the offline
    chat tokenizer: its chat template formats a user message as Qwen3-VL's does), its image and video processors the
    classes' defaults (never run: the pipeline encodes no images into the text)."""
    if isinstance(tokenizer, Qwen3VLProcessor):
        return tokenizer
    from transformers import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(),
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(),
        chat_template=tokenizer.chat_template,
    )


class ProcessorCaptions(ChatCaptions):
    """A tokenizer that formats each caption as Flux3TextEncoderStep does (the processor's chat template, one user
    message, generation prompt added) and pads it on the right, as the pipeline does. Everything else is the
    processor's tokenizer's."""

    def __init__(self, tokens):
        self.processor = processor(tokens)
        super().__init__(self.processor.tokenizer)

    def __call__(self, text, **kwargs):
        return super().__call__(text, **{"padding_side": "right", **kwargs})

    def format(self, text: str) -> str:
        message = [{"role": "user", "content": text}]
        return self.processor.apply_chat_template(message, tokenize=False, add_generation_prompt=True)


def windows(lengths: torch.Tensor, most: int) -> torch.Tensor:
    """Each caption's text window (Flux3TextEncoderStep): its ``lengths`` tokens rounded up to a multiple of
    PAD_MULTIPLE, at most ``most``."""
    return (torch.div(lengths + PAD_MULTIPLE - 1, PAD_MULTIPLE, rounding_mode="floor") * PAD_MULTIPLE).clamp(max=most)


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) patchified latents as (B, h w, C) tokens, row by row (Flux3PrepareLatentsStep)."""
    return latents.flatten(2).transpose(1, 2)


class Flux3(ChatTemplateText, RectifiedFlowSteps, LatentDiffusion):
    NAME, DESCRIPTION = "flux3", "a FLUX.3 model"
    OBJECTIVE = Flux3Objective
    PIPELINE = "Flux3ModularPipeline"
    AUTO_BLOCKS = "Flux3AutoBlocks"  # the pipeline's blocks (diffusers.modular_pipelines)
    FLOW_MAP = False  # the transformer's flow_map: the distilled family's
    PARTS = {
        "transformer": Flux3Transformer2DModel,
        "vae": AutoencoderKLFlux2,
        "text_encoder": Qwen3VLForConditionalGeneration,
    }
    TOKENIZERS = {"tokenizer": INPUT_IDS}
    SCHEDULER = FlowMatchEulerDiscreteScheduler
    FROZEN = ("vae", "text_encoder")
    SDPA_KERNELS = NO_CUDNN_ATTENTION
    LATENT_SHIFT = True  # (encode_latents normalises by the VAE's batch-norm statistics instead)
    TEXT_LAYERS = TEXT_LAYERS
    MUON_EXCLUDE = (
        "timestep_embedder", "target_timestep_embedder", "early_stream_modulations", "single_stream_modulations",
        "x_embedders", "context_embedder", "norm_out", "proj_out",
    )  # fmt: skip
    # every attention's projections (Flux3Attention's), named per block in __init__: the text and image modes' blocks
    # and the joint ones, not the reference-image mode's (IDLE)
    LORA_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0")
    LORA_TEXT_ENCODERS = ()  # Flux3LoraLoaderMixin loads the transformer's adapters only
    # the text mode's blocks and the joint blocks; the image modes' blocks sit in a ModuleDict (mode_blocks.image,
    # mode_blocks.image_cond), which compile_blocks and fp8 do not read as a stack: they stay eager and in bf16
    BLOCKS = {"text": ("txt_mode_blocks", "num_layers"), "single": ("single_transformer_blocks", "num_single_layers")}
    FP8_KEEP = ()  # the modulations are outside the blocks
    encode_latents = Flux2.encode_latents  # FLUX.2 [klein]'s: 2x2 patches, batch-norm normalised (Flux3VaeEncoderStep)

    @classmethod
    def alignable_blocks(cls, get):
        """REPA: the image mode's blocks (their output is the image's tokens) and the joint blocks (their second output
        holds the image's tokens; no reference image in training). Default: the one a third of the way."""
        width = get("num_attention_heads") * get("attention_head_dim")
        blocks = block_stack("image", "mode_blocks.image", get("num_layers"), width, 2, None)
        blocks.update(block_stack("single", "single_transformer_blocks", get("num_single_layers"), width, 2))
        return blocks, a_third_in(blocks)

    def __init__(self, scheduler=None, **options):
        """The rectified flow's (rectified_flow.py: the parts, the objective, the scheduler); a transformer of the other
        variant (a flow map or not) is one line; the reference-image mode frozen (IDLE); LoRA's targets named per
        block of the modes that train."""
        super().__init__(scheduler, **options)
        for path in IDLE:
            self.transformer.get_submodule(path).requires_grad_(False)
        cfg = self.transformer.config
        stacks = (("txt_mode_blocks", cfg.num_layers), ("mode_blocks.image", cfg.num_layers))
        stacks += (("single_transformer_blocks", cfg.num_single_layers),)
        self.LORA_TARGETS = tuple(
            f"{stack}.{i}.{layer}" for stack, n in stacks for i in range(n) for layer in type(self).LORA_TARGETS
        )
        if bool(self.transformer.config.flow_map) != self.FLOW_MAP:
            other = Flux3Distilled if self.transformer.config.flow_map else Flux3
            raise UsageError(
                f"this FLUX.3 transformer has flow_map={bool(self.transformer.config.flow_map)}: it is "
                f"{other.DESCRIPTION}, not {self.DESCRIPTION}; build it as the {other.NAME} family (its presets, or a "
                f"folder its {other.PIPELINE} saved)"
            )

    @classmethod
    def check_config(cls, cfg) -> None:
        """The objective's values checked first (RectifiedFlowSteps'), then: flow_map_step is the distilled model's."""
        super().check_config(cfg)
        if (cfg.objective or {}).get("flow_map_step") and not cls.FLOW_MAP:
            raise UsageError(
                f"{spell('objective.flow_map_step')} applies to the step-distilled FLUX.3 (flux3-distilled, a flow "
                f"map); {cfg.model_name} is {cls.DESCRIPTION}: drop it"
            )

    # --- the pipeline's folder and sampling -------------------------------------------------------------
    @classmethod
    def read_tokenizer(cls, folder: str):
        """The pipeline's tokenizer folder holds a Qwen3VLProcessor."""
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(folder, local_files_only=True)

    @classmethod
    def folder_objective(cls, tokenizers: dict) -> dict:
        """The caption length and padding id of the folder's tokenizer (chat_text.py), read from the processor's."""
        tok = tokenizers.get(INPUT_IDS)
        return super().folder_objective({} if tok is None else {INPUT_IDS: processor(tok).tokenizer})

    @classmethod
    def caption_tokenizers(cls, tokenizers: dict) -> dict:
        return {key: ProcessorCaptions(tok) for key, tok in tokenizers.items()}

    @classmethod
    def blocks(cls):
        """The pipeline's blocks without the prompt upsampler (its docstring: pop it to encode a prompt as given)."""
        blocks = getattr(diffusers.modular_pipelines, cls.AUTO_BLOCKS)()
        blocks.sub_blocks.pop("prompt_upsampler")
        return blocks

    @classmethod
    def open_pipeline(cls, folder: str):
        """A folder this family's pipeline saved, loaded by the modular pipeline's own loader with these blocks, offline
        (its modular_model_index.json's components whose files are in the folder are read from it)."""
        pipe = getattr(diffusers, cls.PIPELINE)(
            blocks=cls.blocks(), pretrained_model_name_or_path=folder, local_files_only=True
        )
        pipe.load_components(local_files_only=True)
        return pipe

    @classmethod
    def sampling_options(cls, pipe, guidance_scale: float, count: int) -> dict:
        """The guidance (the guider's classifier-free scale; the distilled pipeline has none) and the caption length a
        run from the folder trains with."""
        return {"guidance_scale": guidance_scale, "max_sequence_length": qwen_length(pipe.tokenizer.tokenizer)}

    @classmethod
    def sample_images(cls, pipe, call: dict) -> list:
        """One prompt a call, each with its own generator (the pipeline takes one prompt); the guidance is the
        guider's scale."""
        from diffusers import ClassifierFreeGuidance

        call = dict(call)
        prompts, generators, scale = call.pop("prompt"), call.pop("generator"), call.pop("guidance_scale")
        if getattr(pipe, "guider", None) is not None:
            pipe.update_components(guider=ClassifierFreeGuidance(guidance_scale=scale))
        return [pipe(prompt=p, generator=g, **call).images[0] for p, g in zip(prompts, generators)]

    def pipeline(self, tokenizers: dict):
        pipe = self.blocks().init_pipeline()
        pipe.update_components(
            transformer=self.transformer,
            vae=self.vae,
            text_encoder=self.text_encoder,
            tokenizer=self.pipeline_tokenizer(tokenizers),
            scheduler=self.scheduler or FlowMatchEulerDiscreteScheduler.from_config(FLUX3_SCHEDULER),
        )
        return pipe

    def pipeline_tokenizer(self, tokenizers: dict):
        """The processor, its tokenizer padding to this run's caption length (the pipeline's window cap)."""
        tok = tokenizers[INPUT_IDS]
        proc = tok.processor if isinstance(tok, ProcessorCaptions) else processor(tok)
        if proc.tokenizer.model_max_length != self.text_length:
            proc = copy.deepcopy(proc)
            proc.tokenizer.model_max_length = self.text_length
        return proc

    def export(self, out: str, tokenizers: dict) -> None:
        """The modular pipeline's folder (modular_model_index.json), which open_pipeline and diffusers' loader read."""
        self.pipeline(tokenizers).save_pretrained(out, overwrite_modular_index=True)

    # --- shapes -----------------------------------------------------------------------------------
    geometry = staticmethod(Flux2.geometry)  # FLUX.2's: 1024 px, sides of 16 (the VAE's 8, then 2x2 patches)

    @staticmethod
    def denoiser_inputs(configs: dict) -> dict[str, dict[str, int]]:
        """The VAE (its latent channels) and the Qwen3-VL text encoder (its language model's width, in text_config)."""
        t = configs["transformer"]
        return {
            "vae": {"latent_channels": t.get("in_channels", 128) // 4},
            "text_encoder": {"text_config.hidden_size": t.get("joint_attention_dim", 20480) // len(TEXT_LAYERS)},
        }

    @property
    def text_body(self) -> torch.nn.Module:
        """The Qwen3-VL language model that gives the text states (the vision tower and LM head never run)."""
        return self.text_encoder.model.language_model

    @staticmethod
    def text_width_source(width: int) -> str:
        return f"{len(TEXT_LAYERS)} Qwen3-VL layers of {width // len(TEXT_LAYERS)}"

    # --- conditioning ----------------------------------------------------------------------------
    def text_states(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Flux3TextEncoderStep's states: the padding masked, its position ids 1, layers TEXT_LAYERS stacked along the
        width (layer-major within each token); zero after each caption's window."""
        positions = torch.arange(ids.shape[1], device=ids.device)[None].masked_fill(mask == 0, 1)
        out = self.text_body(
            input_ids=ids, attention_mask=mask, position_ids=positions, output_hidden_states=True, use_cache=False
        )
        stacked = torch.stack([out.hidden_states[k] for k in self.TEXT_LAYERS], dim=2).flatten(2)
        window = windows(mask.sum(dim=1), self.text_length)
        return stacked * (torch.arange(ids.shape[1], device=ids.device)[None] < window[:, None]).unsqueeze(-1)

    def encode_text(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(the text states (B, L, D), each caption's window (B,): its rows up to the last that is not zero)."""
        seq, _ = super().encode_text(batch)
        rows = torch.arange(1, seq.shape[1] + 1, device=seq.device)
        return seq, ((seq != 0).any(dim=-1) * rows).amax(dim=1).clamp(min=1)

    # --- objective (rectified_flow.py) -------------------------------------------------------------------
    def image_tokens(self, x0: torch.Tensor) -> int:
        """The transformer's image tokens for latents ``x0``: already patchified (2x2 into channels), one a position."""
        return x0.shape[2] * x0.shape[3]

    def _predict(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, seq: torch.Tensor, window):
        """Packed (prediction, target) for clean patchified latents x0, noise, timesteps t in [0, 1] and the text states
        with their windows: the batch's longest window is what the transformer sees."""
        seq = seq[:, : int(window.max())].to(x0.dtype)
        x_t, velocity = rectified_flow.noised(x0, noise, t)
        extra = {"target_timestep": (t - self.objective["flow_map_step"]).clamp(min=0)} if self.FLOW_MAP else {}
        pred = self.transformer(
            hidden_states=pack(x_t),
            encoder_hidden_states=seq,
            timestep=t.to(x0.dtype),
            img_ids=_prepare_image_ids(x0.shape[2], x0.shape[3], IMAGE_ROPE_SCALE).to(x0.device),
            txt_ids=Flux3TextRoPEInputsStep._prepare_text_ids(seq).to(x0.device),
            **extra,
        ).sample
        return pred, pack(velocity)

    # --- FLOPs ---------------------------------------------------------------------------------------
    def _denoiser_flops(self, image_size: int | tuple[int, int]) -> float:
        """One sample of (h/2)(w/2) image tokens and a caption of max_sequence_length tokens (the longest window)."""
        jump = ("target_timestep",) if self.FLOW_MAP else ()  # the distilled model's: drawn on the tracing device
        return denoiser_flops(
            self, lambda: packed_inputs(self, image_size), lambda: {key: torch.tensor([0.25]) for key in jump}
        )


class Flux3Distilled(Flux3):
    """The step-distilled FLUX.3 (Flux3DistilledModularPipeline: 16 steps, no classifier-free guidance): FLUX.3's step,
    the transformer a flow map given the timestep it jumps to."""

    NAME, DESCRIPTION = "flux3-distilled", "a step-distilled FLUX.3 model"
    PIPELINE = "Flux3DistilledModularPipeline"
    AUTO_BLOCKS = "Flux3DistilledAutoBlocks"
    FLOW_MAP = True
