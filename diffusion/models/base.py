"""The family interface (``Family``) and what every latent text-to-image family shares (``LatentDiffusion``:
frozen encoders, VAE latents, FLOP accounting).

A family is one ComposerModel subclass and one entry in build.FAMILIES. It declares, as class attributes,
its registry name (``NAME``), the diffusers pipeline it corresponds to (``PIPELINE``; None for a standalone
model directory), its parts by the pipeline's folder names (``PARTS``: the trained part first, then VAE and
text encoders), the frozen ones (``FROZEN``), which batch key each tokenizer fills (``TOKENIZERS``), its
sampling scheduler class (``SCHEDULER``), the TrainConfig keys its constructor takes (``OPTIONS``) and its
objective's settings (``OBJECTIVE``, a section declared like diffusion/config.py's). It
implements its rules: ``geometry`` and ``denoiser_inputs`` (from configs alone, before any weight is built),
``check_config`` (its own checks of a run's config), ``batch_shapes`` (its batch layout, keys from
diffusion/batch.py), ``flops_per_sample`` and ``export``. build.py, config.validate, the trainer and
precompute read only these, so adding a family touches none of them (tests/test_family.py proves it).
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
from composer.models import ComposerModel
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

from diffusion.batch import IMAGE, LATENT_MOMENTS, LATENTS, TEXT_EMBEDS
from diffusion.errors import UsageError, spell
from diffusion.models.flops import count_flops
from diffusion.models.renamed_keys import follow_renames
from diffusion.settings import read_section

EVAL_SEED = 1234  # fixed noise and posterior samples at eval, so validation losses compare across evals
# The attention kernels the rectified-flow transformers train with on CUDA (their SDPA_KERNELS): not cuDNN's, whose
# attention backward on an H100 with torch 2.11 returned NaN gradients for flux-tiny's joint attention and ended
# flux-mid's first step in an illegal memory access (docs/performance.md, 2026-11-25).
NO_CUDNN_ATTENTION = "flash,efficient,math"


@dataclass
class Geometry:
    resolution: int  # native image size in pixels
    downsample_factor: int  # image sizes must be multiples of this
    family: str = ""
    denoiser_config: dict = field(default_factory=dict)  # the trained part's config, as its folder or preset gives it


@dataclass
class Block:
    """A block of the trained part as a family names it for REPA (``alignable_blocks``): its module path in the
    trained part, the element of its output that holds the image features (None: the output itself), their width,
    and how many latent pixels a token spans per side (FLUX's 2x2 patches: 2; a UNet block's downsampling);
    ``image_first``: the features are a longer sequence whose first tokens are the image's patches, row by row, and
    the rest are not the image's (Z-Image: padding to a multiple of 32, the caption): only the image's are aligned."""

    path: str
    element: int | None
    width: int
    stride: int
    image_first: bool = False


def true_cfg(max_sequence_length: int, guidance_scale: float, count: int) -> dict:
    """A pipeline's true classifier-free guidance against the empty caption (FluxPipeline's and QwenImagePipeline's
    ``true_cfg_scale`` and ``negative_prompt``, none at guidance 1), its captions at ``max_sequence_length``."""
    options = {"max_sequence_length": max_sequence_length, "true_cfg_scale": guidance_scale}
    return options | ({"negative_prompt": [""] * count} if guidance_scale > 1 else {})


def checked_token_ids(ids: torch.Tensor, key: str, length: int, most: int | None = None) -> torch.Tensor:
    """A batch's token ids under ``key``, refused in one line when a caption has more than ``most`` (default
    ``length``, the objective's max_sequence_length; more where a template's tokens come before the caption's)."""
    most = most or length
    if ids.shape[1] > most:
        template = f" + {most - length} template tokens" if most > length else ""
        raise UsageError(
            f"'{key}' has {ids.shape[1]} tokens, more than this model's max_sequence_length {length}{template}; "
            f"tokenize with max_length={most}"
        )
    return ids


def checked_text_states(seq: torch.Tensor, most: int, takes: str, width: int, encoders: str = "encoder") -> None:
    """Text states (B, L, D) refused, in one line, when longer than a caption's ``most`` tokens or not ``width`` wide
    (``takes``: what the transformer's config calls that width, and what it is made of)."""
    if seq.shape[1] > most:
        raise UsageError(
            f"'{TEXT_EMBEDS}' has {seq.shape[1]} tokens, more than this model's max_sequence_length {most}; precompute "
            f"them again for this model (data.py precompute), or train at objective.max_sequence_length={seq.shape[1]}"
        )
    if seq.shape[-1] != width:
        raise UsageError(
            f"'{TEXT_EMBEDS}' are {seq.shape[-1]} wide; this transformer takes {takes}: precompute with this model's "
            f"text {encoders}"
        )


def block_stack(label: str, path: str, count: int, width: int, stride: int, element: int | None = -1, **kw) -> dict:
    """REPA's names for a stack of ``count`` blocks at ``path`` of the trained part: ``label.i`` -> a Block of
    ``path.i`` (its output's ``element`` holds the image features; ``kw``: image_first)."""
    return {f"{label}.{i}": Block(f"{path}.{i}", element, width, stride, **kw) for i in range(count)}


def a_third_in(blocks: dict) -> str:
    """The block a third of the way in: REPA's default (the paper aligns SiT-XL's 8th of 28)."""
    return list(blocks)[len(blocks) // 3]


@dataclass(frozen=True)
class LeadingImage:
    """A family's ROUTING_LAYOUT (token routing): how its routed blocks take their tokens where they do not follow the joint-attention convention: one
    sequence per sample whose first tokens are the image's, the rest never routed (padding, a caption, zeros up to
    the batch's longest), as Z-Image's ZImageTransformerBlock takes it (diffusers 0.39). ``tokens``: the block's
    parameter that takes the sequence; ``per_token``: its parameters indexed by token like it, (B, S, ...), cut
    alike where given (an attention mask, a rotary table per sample); ``image_tokens``: called with the denoiser's
    arguments, how many image tokens lead each sample's sequence."""

    tokens: str
    per_token: tuple[str, ...]
    image_tokens: Callable[..., int]


def hw(image_size: int | tuple[int, int]) -> tuple[int, int]:
    """(height, width) of an image size: a square's side, or an aspect-ratio bucket's (height, width)."""
    return (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)


def vae_factor(vae_config) -> int:
    return 2 ** (len(vae_config["block_out_channels"]) - 1)


def denoiser_of(model) -> torch.nn.Module:
    """The model's trained part (the first of its family's PARTS)."""
    return getattr(model, next(iter(model.PARTS)))


class Family(ComposerModel):
    """What build.py, config.validate, the trainer and precompute know of a model family."""

    NAME: str  # the registry key (build.FAMILIES) and a preset's "family"
    DESCRIPTION: str  # "an SD model": how messages name a model of this family
    PIPELINE: str | None  # diffusers pipeline class name; None: a standalone model directory
    PARTS: dict[str, type]  # part (pipeline folder) -> class; the first is the one trained
    FROZEN: tuple[str, ...] = ()  # parts that never train (encoders); run in eval mode, maybe in encoder_dtype
    TOKENIZERS: dict[str, str] = {}  # pipeline tokenizer folder -> batch key it fills
    SCHEDULER: type | None = None  # the pipeline's scheduler class (None: the family has none)
    OPTIONS: tuple[str, ...] = ()  # TrainConfig keys its constructor takes: prediction_type, objective
    OBJECTIVE: type | None = None  # its objective section (settings declared like TrainConfig's), if it takes one
    # optimizer=muon: the trained part's modules that stay with AdamW (input and output projections, embeddings);
    # None: the family does not take Muon
    MUON_EXCLUDE: tuple[str, ...] | None = None
    SDPA_KERNELS: str | None = None  # attention kernels it trains with on CUDA unless sdpa_kernels says (None: all)
    # the trained part's stacks of repeated blocks in order, label -> (its ModuleList attribute, the config key of its
    # length): what compile_blocks compiles one block at a time; None: none (the UNets, compiled whole)
    BLOCKS: dict[str, tuple[str, str]] | None = None
    # token routing (techniques/routing/__init__.py): the block stacks it routes around, in BLOCKS' form; None: the family offers
    # no routing (the UNets; transformers whose blocks routing.py cannot hook yet)
    ROUTING: dict[str, tuple[str, str]] | None = None
    # how those blocks take their tokens where not as diffusers' joint-attention blocks do (routing.LeadingImage:
    # Z-Image's single sequence, the image's tokens first); None: the joint-attention convention
    ROUTING_LAYOUT = None
    # the attention processors its routed blocks run that take RoPE -> their twins taking one RoPE table per sample
    # (models/per_sample_rope.py), which routing swaps in; empty: its routed blocks take no RoPE (SD3) or a layout's
    ROUTING_ATTENTION: dict[type, type] = {}
    # REPA (techniques/repa/__init__.py): a classmethod (get: the trained part's config key -> value) -> (block name -> Block,
    # the default block); None: the family has no hidden states to align (the autoencoder)
    alignable_blocks = None
    # LoRA (techniques/lora/__init__.py): the denoiser's layers that get adapters unless lora_targets says (names or their endings,
    # as PEFT matches them); None: the family takes no adapters (the autoencoder)
    LORA_TARGETS: tuple[str, ...] | None = None
    # fp8 (techniques/fp8.py): the linears of the BLOCKS stacks that stay in bf16 (names or their endings: the adaLN
    # modulation layers, fed one vector per sample); None: the family takes no FP8 (the UNets, the autoencoder)
    FP8_KEEP: tuple[str, ...] | None = None
    # lora_text_encoder: the text encoders that get adapters too (CLIP towers; those diffusers' load_lora_weights
    # reads adapters for in this family's pipeline)
    LORA_TEXT_ENCODERS: tuple[str, ...] = ()
    # sampling with this family's diffusers pipeline (eval/sampling.py): the schedulers --sampler may swap in (name ->
    # diffusers class name; empty: its own flow-matching Euler only), and whether a side must be a multiple of 8
    SAMPLERS: dict[str, str] = {}
    SIDES_OF_8 = True

    @classmethod
    def sampling_options(cls, pipe, guidance_scale: float, count: int) -> dict:
        """The keywords of this family's pipeline call beside prompts, steps, size and generators, for ``count``
        prompts: its guidance, and the caption length a run from ``pipe``'s folder trains with where the pipeline's
        default differs."""
        return {"guidance_scale": guidance_scale}

    @classmethod
    def open_pipeline(cls, folder: str):
        """This family's pipeline read from a folder its pipeline saved (sampling): diffusers' DiffusionPipeline
        loader; a modular pipeline's family (FLUX.3) reads it with the modular pipeline's own."""
        from diffusers import DiffusionPipeline

        return DiffusionPipeline.from_pretrained(folder, local_files_only=True)

    @classmethod
    def sample_images(cls, pipe, call: dict) -> list:
        """The images of one call of this family's pipeline (``call``: its keywords, several prompts with a generator
        each); a pipeline that takes one prompt a call (FLUX.3's) is called once a prompt."""
        return pipe(**call).images

    def __init__(self, encoder_dtype: torch.dtype | None = None, **parts: torch.nn.Module):
        """Holds each part under its PARTS name, then freezes the FROZEN ones. Its transformers parts load weights
        saved under another transformers release's names (renamed_keys.py)."""
        super().__init__()
        self.encoder_dtype = encoder_dtype
        for name, part in parts.items():
            setattr(self, name, part)
        follow_renames(self)
        for name in self.FROZEN:
            part = getattr(self, name)
            part.requires_grad_(False)
            part.eval()
            if encoder_dtype is not None:
                torch.nn.Module.to(part, encoder_dtype)  # (diffusers' ModelMixin.to warns about fp32 modules: none)

    # parts kept where they are when the model moves (``.to``, ``.cuda``): a precomputed run's text encoders, which
    # no training step calls (text_encoders_on_cpu); ``parts_on(device)`` brings them over while sampling needs them
    held: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        if not (self.held and recurse):
            return super()._apply(fn, recurse)
        order = list(self._modules)
        held = {name: self._modules.pop(name) for name in self.held}
        try:
            return super()._apply(fn, recurse)
        finally:  # back in their places: the module's order is its state dict's and its parameters'
            modules = {**self._modules, **held}
            self._modules.clear()
            self._modules.update((name, modules[name]) for name in order)

    def text_encoder_parts(self) -> tuple[str, ...]:
        """The frozen parts that encode text (a pipeline's text_encoder, text_encoder_2, ...)."""
        return tuple(name for name in self.FROZEN if name.startswith("text_encoder"))

    @contextlib.contextmanager
    def parts_on(self, device):
        """The held parts on ``device`` for the duration (sampling during a run), then back where they were."""
        homes = {name: next(getattr(self, name).parameters()).device for name in self.held}
        try:
            for name in self.held:
                getattr(self, name).to(device)
            yield self
        finally:
            for name, home in homes.items():
                getattr(self, name).to(home)
            if torch.cuda.is_available() and homes:
                torch.cuda.empty_cache()

    def train(self, mode: bool = True):
        """Frozen parts stay in eval mode, unless they carry trainable adapters (lora_text_encoder: their dropout)."""
        super().train(mode)
        for name in self.FROZEN:
            part = getattr(self, name)
            if not any(p.requires_grad for p in part.parameters()):
                part.eval()
        return self

    @staticmethod
    def geometry(configs: dict, resolution: int | None) -> Geometry:
        """Native resolution and size multiple, from the parts' configs (no weights built)."""
        raise NotImplementedError

    @staticmethod
    def denoiser_inputs(configs: dict) -> dict[str, dict[str, int]]:
        """What the denoiser's config takes from each swappable part: part -> {that part's config key: the
        value it must have}, e.g. ``{"vae": {"latent_channels": 4}}``. Empty: nothing to swap."""
        return {}

    @classmethod
    def check_config(cls, cfg) -> None:
        """This family's own checks of a run's TrainConfig (config.validate calls it; a family that adds checks
        calls it too): a key of OPTIONS the family does not take is refused, and the objective's values are
        checked against the family's OBJECTIVE section."""
        for key, given in (("prediction_type", cfg.prediction_type is not None), ("objective", bool(cfg.objective))):
            if given and key not in cls.OPTIONS:
                takes = f"it takes {', '.join(cls.OPTIONS)}" if cls.OPTIONS else "it takes neither"
                raise UsageError(f"{spell(key)} does not apply to {cfg.model_name} ({cls.DESCRIPTION}); {takes}")
        if cfg.objective:
            cls.objective_options(dict(cfg.objective))

    @classmethod
    def part_class(cls, part: str, config: dict) -> type:
        """The class that builds ``part`` from its config (a preset's, or a folder's config.json): PARTS' (a family
        that trains several classes of a part picks one by the config)."""
        return cls.PARTS[part]

    @classmethod
    def read_tokenizer(cls, folder: str):
        """A tokenizer folder of this family's pipeline (or one given for it), read offline: AutoTokenizer's; a family
        whose pipeline takes a processor as its tokenizer (FLUX.2 [dev]'s PixtralProcessor) reads that instead."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder, local_files_only=True)

    @classmethod
    def folder_objective(cls, tokenizers: dict) -> dict:
        """Objective values a pretrained folder implies (given its tokenizers, batch key -> tokenizer), as a
        preset's "objective" sets them; a run's own objective section overrides them. Default: none."""
        return {}

    @classmethod
    def pipeline_objective(cls, index: dict) -> dict:
        """Objective values a pretrained folder's model_index.json implies (``index``: the settings its pipeline
        records there, as Krea2Pipeline records the text layers it taps), as a preset's "objective" sets them; a
        run's own objective section overrides them. Default: none."""
        return {}

    @classmethod
    def caption_tokenizers(cls, tokenizers: dict) -> dict:
        """The tokenizers that turn a caption into the batch's token ids (batch key -> tokenizer), given the preset's
        or folder's: by default those; a family whose pipeline formats a caption before tokenizing it (FLUX.2's
        chat template) wraps them so, and unwraps them where it builds its pipeline."""
        return tokenizers

    @classmethod
    def objective_options(cls, given: dict | None) -> dict:
        """The objective section's values: its defaults updated by ``given`` (a preset's, then a run's), each
        typed and checked by its declaration; an unknown key is named."""
        label = cls.DESCRIPTION.split(" ", 1)[-1].removesuffix(" model")  # "a FLUX model" -> FLUX
        return asdict(read_section(cls.OBJECTIVE, given, "objective", label))

    def batch_shapes(self, image_size: int, precomputed: bool) -> dict[str, tuple]:
        """Layout of one sample: batch key (diffusion/batch.py) -> (shape, dtype, exclusive upper bound for
        integer keys); synthetic data and the loaders follow it. Empty for precomputed: not supported."""
        raise NotImplementedError

    def flops_per_sample(self, image_size: int, online: bool = True) -> dict[str, float]:
        """FLOPs of one training sample: ``denoiser`` (forward + backward), ``encoders``, ``total``."""
        raise NotImplementedError

    def flops_per_batch(self, batch: dict) -> float:
        """Used by Composer's SpeedMonitor for MFU."""
        raise NotImplementedError

    def export(self, out: str, tokenizers: dict) -> None:
        """A directory that diffusers' ``from_pretrained`` loads (export.py)."""
        raise NotImplementedError


class LatentDiffusion(Family):
    """A text-to-image model denoising VAE latents; subclasses add the denoiser and the objective."""

    LATENT_SHIFT: bool  # whether the pipeline subtracts the VAE's shift_factor (FLUX) or not (SD)

    def __init__(self, encoder_dtype: torch.dtype | None = None, **parts: torch.nn.Module):
        super().__init__(encoder_dtype, **parts)
        self._flops_per_sample: dict[tuple, dict[str, float]] = {}
        # training techniques installed on the trained part (token routing), each also given to the fresh copy
        # that FLOP counting traces (count_flops' ``prepare``), so the count is that of the step that runs
        self.denoiser_techniques: list[Callable[[torch.nn.Module], object]] = []
        # FLOPs a technique adds per sample beside the denoiser's (REPA's encoder and projector): name ->
        # f(image_size, online); each is a key of flops_per_sample and part of its total
        self.flops_extras: dict[str, Callable[..., float]] = {}
        # text encoders carrying trainable adapters (lora_text_encoder): name -> what installs them on the fresh
        # copy FLOP counting traces; text encoding then keeps gradients (text_grad)
        self.trained_text_encoders: dict[str, Callable[[torch.nn.Module], object]] = {}

    def prepare_traced(self, denoiser: torch.nn.Module) -> None:
        for install in self.denoiser_techniques:
            install(denoiser)

    def text_grad(self, batch: dict):
        """The grad mode text encoding runs in: none through frozen text encoders; the caller's when adapters on them
        train (lora_text_encoder), whose batches must then carry token ids, not precomputed text embeddings."""
        if not self.trained_text_encoders:
            return torch.no_grad()
        if TEXT_EMBEDS in batch:
            raise UsageError(
                f"{spell('lora_text_encoder', 'true')}: this batch carries precomputed '{TEXT_EMBEDS}', made without "
                "the text encoder's adapters; train on image shards with captions"
            )
        return contextlib.nullcontext()

    def text_encoder_flops(self, name: str, length: int) -> float:
        """One caption of ``length`` tokens through text encoder ``name``: its forward, and with adapters on it
        (lora_text_encoder) the backward that trains them (input gradients, no weight gradients of its base)."""
        part, adapters = getattr(self, name), self.trained_text_encoders.get(name)
        return count_flops(
            type(part),
            part.config,
            train=adapters is not None,
            prepare=adapters,
            args=lambda: (torch.zeros(1, length, dtype=torch.long),),
        )

    @property
    def vae_scale_factor(self) -> int:
        return vae_factor(self.vae.config)

    @property
    def latent_channels(self) -> int:
        return self.vae.config.latent_channels

    @torch.no_grad()
    def latent_moments(self, images: torch.Tensor) -> torch.Tensor:
        """VAE posterior parameters (B, 2C, h, w): mean and log-variance, in fp32."""
        moments = self.vae.encoder(images.to(self.encoder_dtype or images.dtype))
        if self.vae.config.use_quant_conv:
            moments = self.vae.quant_conv(moments)
        return moments.float()

    def text_features(self, batch: dict) -> dict[str, torch.Tensor]:
        """The family's text conditioning, keyed as precomputed batches carry it."""
        raise NotImplementedError

    @torch.no_grad()
    def precompute(self, batch: dict) -> dict[str, torch.Tensor]:
        """What ``data.py precompute`` stores for an online batch (images + token ids): the VAE moments
        (training samples from them each step) and the text encoders' outputs."""
        return {LATENT_MOMENTS: self.latent_moments(batch[IMAGE]), **self.text_features(batch)}

    def posterior_moments(self, batch: dict) -> torch.Tensor:
        """The VAE posterior's moments of a batch (stored, or encoded from its images), their channels checked."""
        channels = self.latent_channels
        moments = batch[LATENT_MOMENTS].float() if LATENT_MOMENTS in batch else self.latent_moments(batch[IMAGE])
        if moments.shape[1] != 2 * channels:
            raise UsageError(
                f"'{LATENT_MOMENTS}' has {moments.shape[1]} channels; this model's VAE needs "
                f"{2 * channels} (mean and log-variance of {channels}); "
                "precompute the latents with this model's VAE"
            )
        return moments

    @torch.no_grad()
    def encode_latents(
        self, batch: dict, generator: torch.Generator | None = None, posterior_noise: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Scaled latents: sampled from the VAE posterior (online or stored moments) or given as is.
        ``posterior_noise`` (B,C,h,w) fixes the sample: mean + std * noise."""
        cfg = self.vae.config
        z = self.sample_latents(batch, generator, posterior_noise)
        shift = (getattr(cfg, "shift_factor", None) or 0.0) if self.LATENT_SHIFT else 0.0
        return (z - shift) * cfg.scaling_factor

    def sample_latents(
        self, batch: dict, generator: torch.Generator | None = None, posterior_noise: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Unscaled latents: LATENTS as they are, else a sample of the VAE posterior (see encode_latents)."""
        if LATENTS in batch:
            return batch[LATENTS].float()
        posterior = DiagonalGaussianDistribution(self.posterior_moments(batch))
        if posterior_noise is None:
            return posterior.sample(generator=generator)
        return posterior.mean + posterior.std * posterior_noise

    def batch_size_and_image_size(self, batch: dict) -> tuple[int, int | tuple[int, int]]:
        """Samples in the batch and their image size: the side of a square, else (height, width) (a bucket)."""
        if IMAGE in batch:
            n, (h, w) = batch[IMAGE].shape[0], batch[IMAGE].shape[-2:]
        else:
            latents = batch[LATENTS] if LATENTS in batch else batch[LATENT_MOMENTS]
            n, (h, w) = latents.shape[0], (d * self.vae_scale_factor for d in latents.shape[-2:])
        return n, (int(h) if h == w else (int(h), int(w)))

    def flops_per_sample(self, image_size: int, online: bool = True) -> dict[str, float]:
        """FLOPs of one training sample, counted once per shape by tracing on the meta device:
        ``denoiser`` (forward + backward), ``encoders`` (frozen parts' forward, when online), ``total``."""
        key = (image_size, online)
        if key not in self._flops_per_sample:
            flops = {
                "denoiser": self._denoiser_flops(image_size),
                "encoders": self._encoder_flops(image_size) if online else 0.0,
            }
            flops.update({name: extra(image_size, online) for name, extra in self.flops_extras.items()})
            flops["total"] = sum(flops.values())
            self._flops_per_sample[key] = flops
        return self._flops_per_sample[key]

    def flops_per_batch(self, batch: dict) -> float:
        """Used by Composer's SpeedMonitor for MFU."""
        n, size = self.batch_size_and_image_size(batch)
        return n * self.flops_per_sample(size, online=IMAGE in batch)["total"]

    def pipeline(self, tokenizers: dict):
        """The matching diffusers pipeline around this model's own modules (no copy): for sampling
        and for export with ``save_pretrained``."""
        raise NotImplementedError

    def export(self, out: str, tokenizers: dict) -> None:
        """A diffusers pipeline directory that ``from_pretrained`` loads, its tokenizer folders read by the family's own
        tokenizer classes, slow and fast (tokenizer.finish_export)."""
        from diffusion.models.tokenizer import finish_export

        pipeline = self.pipeline(tokenizers)
        pipeline.save_pretrained(out)
        finish_export(out, pipeline)
