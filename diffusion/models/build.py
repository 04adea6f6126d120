"""Build a model from a preset name or a local diffusers pipeline directory.

``build_model(name)`` is the one entry point: a preset (presets.py) is built offline with random
weights; a directory is loaded with ``from_pretrained(..., local_files_only=True)``. Nothing reaches a
model hub.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from transformers import AutoTokenizer, CLIPTextConfig, CLIPTextModel

from diffusion.errors import UsageError
from diffusion.models.presets import PRESETS, get_preset
from diffusion.models.sd import StableDiffusion
from diffusion.models.tokenizer import build_tokenizer

# diffusers pipeline class (model_index.json "_class_name") -> our family
PIPELINE_FAMILIES = {"StableDiffusionPipeline": "sd"}


@dataclass
class Geometry:
    resolution: int  # native image size in pixels
    downsample_factor: int  # image sizes must be multiples of this (VAE factor x UNet downsampling)


def describe(name_or_path: str, flag: str = "--model_name") -> Geometry:
    """Shape facts read from configs only (no weights built), to validate flags before a slow build."""
    if name_or_path in PRESETS:
        unet, vae = PRESETS[name_or_path]["unet"], PRESETS[name_or_path]["vae"]
    else:
        _check_dir(name_or_path, flag)
        unet = UNet2DConditionModel.load_config(name_or_path, subfolder="unet", local_files_only=True)
        vae = AutoencoderKL.load_config(name_or_path, subfolder="vae", local_files_only=True)
    vae_factor = 2 ** (len(vae["block_out_channels"]) - 1)
    return Geometry(resolution=unet["sample_size"] * vae_factor,
                    downsample_factor=vae_factor * 2 ** (len(unet["block_out_channels"]) - 1))


@dataclass
class Built:
    model: torch.nn.Module
    tokenizer: object
    family: str
    resolution: int


def build_model(name_or_path: str, *, tokenizer_path: str | None = None, prediction_type: str | None = None,
                encoder_dtype: torch.dtype | None = None, flag: str = "--model_name") -> Built:
    if name_or_path in PRESETS:
        spec = get_preset(name_or_path)
        parts = _sd_from_preset(spec)
        resolution = spec["resolution"]
        tokenizer = build_tokenizer(spec["tokenizer"])
    else:
        parts, resolution = _sd_from_dir(name_or_path, flag)
        tokenizer = AutoTokenizer.from_pretrained(os.path.join(name_or_path, "tokenizer"),
                                                  local_files_only=True) \
            if os.path.isdir(os.path.join(name_or_path, "tokenizer")) else None
    if tokenizer_path is not None:
        if not os.path.isdir(tokenizer_path):
            raise UsageError(f"--tokenizer: directory {tokenizer_path!r} does not exist; pass a local "
                             "tokenizer directory (e.g. the 'tokenizer' folder of a diffusers pipeline)")
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    if prediction_type is not None:
        parts["noise_scheduler"] = DDPMScheduler.from_config(parts["noise_scheduler"].config,
                                                             prediction_type=prediction_type)
    model = StableDiffusion(**parts, encoder_dtype=encoder_dtype)
    return Built(model=model, tokenizer=tokenizer, family="sd", resolution=resolution)


def _sd_from_preset(spec: dict) -> dict:
    return {
        "unet": UNet2DConditionModel.from_config(spec["unet"]),
        "vae": AutoencoderKL.from_config(spec["vae"]),
        "text_encoder": CLIPTextModel(CLIPTextConfig(**spec["text_encoder"])),
        "noise_scheduler": DDPMScheduler.from_config(spec["scheduler"]),
    }


def _check_dir(path: str, flag: str) -> str:
    """The pipeline class of a local diffusers directory, or a UsageError saying what to pass."""
    if not os.path.isdir(path):
        looks_like_path = os.sep in path or path.startswith(".")
        what = f"directory {path!r} does not exist" if looks_like_path else \
            f"{path!r} is neither a preset nor a local directory"
        raise UsageError(f"{flag}: {what}. Presets: {', '.join(PRESETS)}; or pass a local diffusers "
                         "pipeline directory (models are never downloaded).")
    index = os.path.join(path, "model_index.json")
    if not os.path.isfile(index):
        raise UsageError(f"{flag}: {path!r} has no model_index.json; pass a diffusers pipeline directory "
                         "(as saved by save_pretrained) or a preset name")
    with open(index) as f:
        cls = json.load(f).get("_class_name", "")
    if cls not in PIPELINE_FAMILIES:
        raise UsageError(f"{flag}: {path!r} holds a {cls or 'unknown'} pipeline; supported: "
                         f"{', '.join(PIPELINE_FAMILIES)}")
    for sub in ("unet", "vae", "text_encoder", "scheduler"):
        if not os.path.isdir(os.path.join(path, sub)):
            raise UsageError(f"{flag}: {path!r} lacks the '{sub}' folder a {cls} needs")
    return cls


def _sd_from_dir(path: str, flag: str) -> tuple[dict, int]:
    _check_dir(path, flag)
    kw = {"local_files_only": True}
    unet = UNet2DConditionModel.from_pretrained(path, subfolder="unet", **kw)
    vae = AutoencoderKL.from_pretrained(path, subfolder="vae", **kw)
    parts = {
        "unet": unet,
        "vae": vae,
        "text_encoder": CLIPTextModel.from_pretrained(path, subfolder="text_encoder", **kw),
        "noise_scheduler": DDPMScheduler.from_pretrained(path, subfolder="scheduler", **kw),
    }
    resolution = unet.config.sample_size * 2 ** (len(vae.config.block_out_channels) - 1)
    return parts, resolution
