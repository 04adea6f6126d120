"""REPA (representation alignment; Yu et al., ICLR 2025) for any family that names its denoiser's blocks: while
training, one block's output is projected by a small trainable MLP and pulled, token by token, towards a frozen
pretrained vision encoder's patch features of the clean image (loss 1 - cosine similarity, weighted by
``repa_weight``, added to the diffusion loss until ``repa_until``).

A family opts in with ``alignable_blocks`` (models/base.py): its blocks by name (FLUX ``double.N``/``single.N``,
the UNets ``down.N``/``mid``/``up.N``), where each sits in the trained part, which element of its output holds the
image features, and their width. A token sequence (B, N, D) or a feature map (B, C, h, w) is read as tokens on the
image's grid; the encoder runs on the image resized to its own resolution (the aspect kept, sides a multiple of
its patch) and its patch grid is interpolated to the denoiser's where they differ (any bucket shape).

The pieces: ``check_alignment`` (the keys, before a weight is built), ``install_alignment`` (the encoder, loaded
frozen and kept out of the model's state, so checkpoints do not carry it; the projector, a child of the model
named ``repa_projector``: trained, saved, resumed, averaged by EMA like any trainable weight, sharded as its own
FSDP2 unit, never exported or used by the sampler; a forward hook on the block) and ``RepaLoss``, the Composer
algorithm that adds the loss after the model's own (Composer logs ``loss/train/diffusion`` and
``loss/train/repa`` beside the total). Under token routing (diffusion/techniques/routing/tokens.py) a block inside the routed span
outputs only its kept tokens: they are aligned with the encoder's features at those tokens' places.

On precomputed latents the encoder ran once, in ``data.py precompute --repa_encoder DIR``: its patch feature maps
(``FrozenEncoder.maps``, the same call the online path makes) are stored beside the latents, each batch carries them
(``REPA_FEATURES``) and the encoder is not loaded: the loader checks the dataset's record of the encoder
(``encoder_identity``) against ``repa_encoder``, and the run's FLOPs count the projector alone.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from composer.core import Algorithm, Event, State, Time
from composer.utils import dist
from torch.distributed.tensor import DTensor

from diffusion.batch import IMAGE, LATENT_MOMENTS, LATENTS, REPA_FEATURES
from diffusion.errors import UsageError, spell
from diffusion.models.base import Block, denoiser_of, hw
from diffusion.models.flops import count_flops
from diffusion.models.hub_cache import hub_id_to_path
from diffusion.settings import torch_dtype

PROJECTOR = "repa_projector"  # the projector's name in the model (and its checkpoints' keys' prefix)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # DINOv2's, when the folder says none
DUAL_TOWERS = {"clip": "CLIPVisionModel", "siglip": "SiglipVisionModel"}  # image-text models: their vision tower


@dataclass
class EncoderSpec:
    """What the encoder folder's config says: where it is, its class, patch and native image size, width."""

    path: str
    cls: str
    patch: int
    image_size: int
    width: int


def encoder_spec(name: str) -> EncoderSpec:
    """The vision encoder ``name`` (a local folder or a cached hub id) read from its config.json alone, or a
    one-line UsageError saying what the folder holds instead."""
    key = spell("repa_encoder")
    path = hub_id_to_path(name, key)
    config_file = os.path.join(path, "config.json")
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (OSError, ValueError):
        what = "is not a directory" if not os.path.isdir(path) else "has no readable config.json"
        raise UsageError(
            f"{spell('repa_encoder', name)} {what}; pass a folder saved with save_pretrained of a transformers "
            "vision model (Dinov2Model, CLIPVisionModel, SiglipVisionModel) or its id in the local Hugging Face cache"
        ) from None
    model_type = config.get("model_type", "?")
    vision = config.get("vision_config", config) if model_type in DUAL_TOWERS else config
    if not isinstance(vision, dict) or not {"patch_size", "image_size", "hidden_size"} <= set(vision):
        raise UsageError(
            f"{spell('repa_encoder', name)} holds a {model_type!r} model, not a vision model that yields patch tokens "
            "(its config has no patch_size/image_size); pass a Dinov2Model, CLIPVisionModel or SiglipVisionModel "
            "folder (or a CLIP/SigLIP model, whose vision tower is used)"
        )
    cls = DUAL_TOWERS.get(model_type, "AutoModel")
    size = vision["image_size"]
    size = min(size) if isinstance(size, (list, tuple)) else size
    return EncoderSpec(path, cls, int(vision["patch_size"]), int(size), int(vision["hidden_size"]))


def encoder_size(spec: EncoderSpec, height: int, width: int) -> tuple[int, int]:
    """The size the encoder reads an image of height x width at: its short side at the encoder's own resolution,
    the aspect kept, both sides a multiple of its patch."""
    p, scale = spec.patch, spec.image_size / min(height, width)
    return max(p, round(height * scale / p) * p), max(p, round(width * scale / p) * p)


def feature_shape(spec: EncoderSpec, height: int, width: int) -> tuple[int, int, int]:
    """The (width, rows, columns) of the encoder's patch feature map of one height x width image."""
    rows, cols = (side // spec.patch for side in encoder_size(spec, height, width))
    return spec.width, rows, cols


WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth")
VOLATILE = ("_name_or_path", "transformers_version", "torch_dtype", "dtype")  # config keys that name no weight


def encoder_identity(spec: EncoderSpec) -> dict:
    """What makes the encoder's features what they are: its config (less the keys that change on a copy or a
    save), its image normalisation and a digest of its weight files' bytes; with its path, for messages."""
    with open(os.path.join(spec.path, "config.json")) as f:
        config = {k: v for k, v in json.load(f).items() if k not in VOLATILE}
    weights = hashlib.sha256()
    for name in sorted(n for n in os.listdir(spec.path) if n.endswith(WEIGHT_FILES)):
        with open(os.path.join(spec.path, name), "rb") as f:
            while chunk := f.read(1 << 24):
                weights.update(chunk)
    mean, std = _normalisation(spec.path)
    return {
        "path": spec.path,
        "class": spec.cls,
        "config_sha256": hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest(),
        "weights_sha256": weights.hexdigest(),
        "image_mean": list(mean),
        "image_std": list(std),
    }


def identity_problem(recorded: dict, given: dict) -> str | None:
    """How the encoder ``given`` differs from the one whose features were ``recorded`` (None: the same one)."""
    for key, what in (("config_sha256", "config"), ("weights_sha256", "weights"), ("image_mean", "image mean"),
                      ("image_std", "image std")):  # fmt: skip
        if recorded.get(key) != given.get(key):
            return f"its {what} {'differs' if what == 'config' else 'differ'} from {recorded.get('path')}'s"
    return None


def projector(width: int, hidden: int, out: int) -> torch.nn.Sequential:
    """REPA's projector: three linear layers with SiLU between them (the paper's MLP)."""
    return torch.nn.Sequential(
        torch.nn.Linear(width, hidden), torch.nn.SiLU(), torch.nn.Linear(hidden, hidden), torch.nn.SiLU(),
        torch.nn.Linear(hidden, out),
    )  # fmt: skip


def load_encoder(spec: EncoderSpec, dtype: torch.dtype | None) -> torch.nn.Module:
    import transformers

    encoder = getattr(transformers, spec.cls).from_pretrained(spec.path)
    encoder.requires_grad_(False).eval()
    return encoder.to(dtype) if dtype is not None else encoder


class FrozenEncoder:
    """The frozen vision encoder and what it takes: the image size it reads, its normalisation; ``maps``: its
    patch features of a batch of images, what training aligns with (online) and what precompute stores."""

    def __init__(self, spec: EncoderSpec, dtype: torch.dtype | None = None):
        self.spec, self.module = spec, load_encoder(spec, dtype)
        self.mean, self.std = _normalisation(spec.path)
        takes = "interpolate_pos_encoding" in inspect.signature(self.module.forward).parameters
        self.kwargs = {"interpolate_pos_encoding": True} if takes else {}  # CLIP, SigLIP; DINOv2 always does

    def to(self, device) -> "FrozenEncoder":
        self.module.to(device)
        return self

    @torch.no_grad()
    def maps(self, images: torch.Tensor) -> torch.Tensor:
        """The patch features of ``images`` ([-1, 1]) as (B, width, rows, columns) maps in fp32."""
        size = encoder_size(self.spec, *images.shape[-2:])
        x = (images.float() + 1) / 2
        if size != tuple(images.shape[-2:]):
            x = F.interpolate(x, size=size, mode="bicubic", align_corners=False, antialias=True)
        mean, std = (torch.tensor(v, device=x.device).view(1, 3, 1, 1) for v in (self.mean, self.std))
        dtype = next(self.module.parameters()).dtype
        out = self.module(pixel_values=((x - mean) / std).to(dtype), **self.kwargs).last_hidden_state
        rows, cols = size[0] // self.spec.patch, size[1] // self.spec.patch
        feats = out[:, -rows * cols :].float()  # the patch tokens come last (after CLS and any registers)
        return feats.transpose(1, 2).reshape(len(x), -1, rows, cols)

    def flops(self, height: int, width: int) -> float:
        """One forward on one height x width image, at the size the encoder reads it."""
        size = encoder_size(self.spec, height, width)
        return count_flops(
            type(self.module), self.module.config, train=False, args=lambda: (torch.randn(1, 3, *size),),
            kwargs=lambda: self.kwargs,
        )  # fmt: skip


class StoredFeatures:
    """What data.py precompute stores for REPA on the latents: the frozen encoder's patch feature maps of each
    image, fp16, on the encoder's own grid for the image's size (the technique's ``store``)."""

    def __init__(self, spec: EncoderSpec, dtype: str | None = None):
        self.encoder = FrozenEncoder(spec, torch_dtype(dtype))

    def to(self, device) -> "StoredFeatures":
        self.encoder.to(device)
        return self

    def columns(self, image_size) -> dict:
        return {REPA_FEATURES: (feature_shape(self.encoder.spec, *hw(image_size)), "float16")}

    def rows(self, images: torch.Tensor) -> dict:
        """The maps in fp16; one that fp16 cannot hold is one line, not an inf in the data."""
        maps = self.encoder.maps(images)
        if maps.abs().max() > torch.finfo(torch.float16).max:
            raise UsageError(
                f"{spell('repa_encoder')} {self.encoder.spec.path}: a feature reaches {maps.abs().max().item():.3g}, "
                "beyond fp16's range, in which they are stored; train on the image shards (precomputed_latents=false) "
                "with this encoder"
            )
        return {REPA_FEATURES: maps.cpu().numpy().astype(np.float16)}


def on_grid(maps: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """Feature maps (B, E, rows, columns) as tokens (B, N, E) on the denoiser's ``grid``, interpolated where the
    grids differ."""
    if tuple(maps.shape[-2:]) != tuple(grid):
        maps = F.interpolate(maps, size=grid, mode="bilinear", align_corners=False, antialias=True)
    return maps.flatten(2).transpose(1, 2)


def install_alignment(model, cfg, block: Block) -> "RepaLoss":
    """The frozen encoder (not on precomputed latents: their batches carry its features), ``model.repa_projector``
    and the hook on ``block`` (the family's, as repa_block names it); the algorithm that adds the loss."""
    part = denoiser_of(model)
    spec = encoder_spec(cfg.repa_encoder)
    hidden = cfg.repa_projector_width or min(2048, 4 * spec.width)
    setattr(model, PROJECTOR, projector(block.width, hidden, spec.width))
    encoder = None if cfg.precomputed_latents else FrozenEncoder(spec, torch_dtype(cfg.encoder_dtype))
    until = Time.from_timestring(cfg.repa_until) if cfg.repa_until else None
    alignment = RepaLoss(model, encoder, spec, cfg.repa_weight, until, block.stride, block.image_first)
    part.get_submodule(block.path).register_forward_hook(partial_capture(alignment, block.element))
    model._flops_per_sample.clear()
    model.flops_extras["repa"] = alignment.flops
    return alignment


def partial_capture(alignment: "RepaLoss", element: int | None):
    def capture(block, args, output):
        if alignment.active and block.training and torch.is_grad_enabled():
            alignment.capture(block, output if element is None else output[element])

    return capture


def _image_grid(tokens: int, height: int, width: int) -> tuple[int, int]:
    """The (rows, columns) grid of ``tokens`` on an image of height x width."""
    rows = max(1, round((tokens * height / width) ** 0.5))
    if rows * (tokens // rows) != tokens:
        raise RuntimeError(f"REPA: {tokens} tokens do not tile a {height}x{width} image")
    return rows, tokens // rows


class RepaLoss(Algorithm):
    """Adds REPA's loss to the model's (see the module docstring); ``until``: when it stops (None: never);
    ``encoder``: None when the batches carry the encoder's stored features (precomputed latents)."""

    def __init__(
        self, model, encoder: FrozenEncoder | None, spec: EncoderSpec, weight: float, until: Time | None,
        stride: int = 1, image_first: bool = False,
    ):  # fmt: skip
        self.model, self.encoder, self.spec, self.weight, self.until = model, encoder, spec, weight, until
        self.stride = stride  # latent pixels per token side at the aligned block
        self.image_first = image_first  # the block's image tokens lead a longer sequence (models.base.Block)
        self.active, self.captured = False, None

    def match(self, event: Event, state: State) -> bool:
        return event in (Event.FIT_START, Event.BEFORE_FORWARD, Event.AFTER_LOSS)

    def apply(self, event: Event, state: State, logger) -> None:
        if event == Event.FIT_START:
            if self.encoder is not None:
                self.encoder.to(next(p for p in self.model.parameters()).device)
        elif event == Event.BEFORE_FORWARD:
            self.captured = None
            self.active = self.until is None or state.timestamp.get(self.until.unit) < self.until
        elif self.active and self.captured is not None:
            base = state.loss["total"] if isinstance(state.loss, dict) else state.loss
            repa = self.loss(state.batch)
            state.loss = {"total": base + self.weight * repa, "diffusion": base, "repa": repa}
            self.captured = None
        elif not self.active and self._under_ddp():
            # once REPA has stopped, DDP still expects a gradient for every parameter: the projector gets zeros
            # (Composer's find_unused_parameters cannot serve: the projector runs outside the model's forward), and
            # AdamW's momentum moves it on a little, unused; one rank and FSDP2 expect no gradient of it
            zero = sum(p.sum() for p in self._projector().parameters()) * 0.0
            state.loss = (
                {k: v + zero for k, v in state.loss.items()} if isinstance(state.loss, dict) else state.loss + zero
            )

    def _under_ddp(self) -> bool:
        return dist.get_world_size() > 1 and not isinstance(next(self._projector().parameters()), DTensor)

    def _projector(self) -> torch.nn.Module:
        return getattr(self.model, PROJECTOR)

    def capture(self, block, hidden: torch.Tensor) -> None:
        """Keep the block's image features as tokens (B, N, D) with, under routing, the kept tokens' indices."""
        kept, full = None, None
        if hidden.ndim == 4:
            full = tuple(hidden.shape[-2:])
            hidden = hidden.flatten(2).transpose(1, 2)
        router = getattr(block, "token_router", None)  # set on the blocks of a routing span
        if router is not None and router.kept is not None and hidden.shape[1] != router.entered.shape[1]:
            kept = router.kept  # inside the span: this block saw each sample's kept tokens only
        tokens = router.entered.shape[1] if kept is not None else hidden.shape[1]
        self.captured = (hidden, kept, full, tokens)

    def loss(self, batch: dict) -> torch.Tensor:
        """1 - the mean cosine similarity of the projected tokens and the encoder's features at their places: the
        batch's stored features (precomputed latents) or the encoder's on its images."""
        hidden, kept, grid, tokens = self.captured
        if REPA_FEATURES in batch:
            maps, picture = (
                batch[REPA_FEATURES].float(),
                next(batch[k] for k in (LATENT_MOMENTS, LATENTS) if k in batch),
            )
            side = self.stride  # the picture's pixels per token side: latents
        elif self.encoder is not None:
            maps, picture = self.encoder.maps(batch[IMAGE]), batch[IMAGE]
            side = self.stride * self.model.vae_scale_factor  # images
        else:
            raise RuntimeError(f"REPA: a precomputed batch without '{REPA_FEATURES}' (the loader checks for them)")
        if self.image_first:  # the image's tokens first, as many as its grid has; the rest (padding, caption) not
            grid = (picture.shape[-2] // side, picture.shape[-1] // side)
            hidden = hidden[:, : grid[0] * grid[1] if kept is None else kept.shape[1]]  # in a routed span: the kept
        target = on_grid(maps, grid or _image_grid(tokens, *picture.shape[-2:]))  # (B, rows x columns, E)
        if kept is not None:
            target = target.gather(1, kept[..., None].expand(-1, -1, target.shape[-1]))
        projected = self._projector()(hidden.float())  # a bf16 denoiser (lora_base_dtype) meets the fp32 projector
        return 1 - F.cosine_similarity(projected.float(), target, dim=-1).mean()

    def features(self, images: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """The encoder's patch features of ``images`` ([-1, 1]) on a ``grid`` of tokens (B, N, E), in fp32."""
        return on_grid(self.encoder.maps(images), grid)

    def flops(self, image_size, online: bool = True) -> float:
        """The encoder's forward on one image (none when the batches carry its features) and the projector's
        forward and backward over one image's tokens."""
        height, width = hw(image_size)
        encoder = self.encoder.flops(height, width) if self.encoder is not None and online else 0.0
        matmuls = sum(m.weight.numel() for m in getattr(self.model, PROJECTOR) if isinstance(m, torch.nn.Linear))
        side = self.model.vae_scale_factor * self.stride  # image pixels per token side at the aligned block
        return encoder + 6 * matmuls * max(1, height // side) * max(1, width // side)


def _normalisation(path: str) -> tuple[tuple, tuple]:
    """The encoder's image mean and std (on [0, 1] pixels) from its folder's preprocessor_config.json, else
    ImageNet's (DINOv2's own)."""
    try:
        with open(os.path.join(path, "preprocessor_config.json")) as f:
            pre = json.load(f)
        return tuple(pre["image_mean"]), tuple(pre["image_std"])
    except (OSError, ValueError, KeyError):
        return IMAGENET_MEAN, IMAGENET_STD
