"""Build a model from a preset name or a local diffusers pipeline directory.

``build_model(name)`` is the one entry point: a preset (presets.py) is built offline with random
weights; a directory is loaded with ``from_pretrained(..., local_files_only=True)``. Nothing reaches a
model hub. Which parts to build, and with which classes, comes from the family's class attributes.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from diffusers import ModelMixin
from transformers import AutoTokenizer

from diffusion.errors import UsageError
from diffusion.models.base import Geometry, LatentDiffusion
from diffusion.models.flux import Flux
from diffusion.models.presets import PRESETS, get_preset
from diffusion.models.sd import StableDiffusion
from diffusion.models.tokenizer import build_tokenizer

FAMILIES: dict[str, type[LatentDiffusion]] = {"sd": StableDiffusion, "flux": Flux}
BY_PIPELINE = {cls.PIPELINE: cls for cls in FAMILIES.values()}


@dataclass
class Built:
    model: LatentDiffusion
    tokenizers: dict[str, object]  # batch key -> tokenizer that fills it from a caption
    family: str
    resolution: int


def _family_of_dir(path: str, flag: str) -> type[LatentDiffusion]:
    """The family of a local diffusers pipeline directory, or a UsageError saying what to pass."""
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
        name = json.load(f).get("_class_name", "")
    if name not in BY_PIPELINE:
        raise UsageError(f"{flag}: {path!r} holds a {name or 'unknown'} pipeline; supported: "
                         f"{', '.join(BY_PIPELINE)}")
    cls = BY_PIPELINE[name]
    for sub in cls.PARTS:
        if not os.path.isdir(os.path.join(path, sub)):
            raise UsageError(f"{flag}: {path!r} lacks the '{sub}' folder a {name} needs")
    return cls


def describe(name_or_path: str, flag: str = "--model_name") -> Geometry:
    """Shape facts read from configs only (no weights built), to validate flags before a slow build."""
    if name_or_path in PRESETS:
        spec = PRESETS[name_or_path]
        geometry = FAMILIES[spec["family"]].geometry(spec, spec.get("resolution"))
        geometry.family = spec["family"]
        return geometry
    cls = _family_of_dir(name_or_path, flag)
    configs = {}
    for part in cls.PARTS:
        with open(os.path.join(name_or_path, part, "config.json")) as f:
            configs[part] = json.load(f)
    geometry = cls.geometry(configs, None)
    geometry.family = _family_name(cls)
    return geometry


def _part_from_config(cls: type, config: dict) -> torch.nn.Module:
    if issubclass(cls, ModelMixin):
        return cls.from_config(config)
    return cls(cls.config_class(**config))  # transformers


def build_model(name_or_path: str, *, tokenizer_path: str | None = None, encoder_dtype: torch.dtype | None = None,
                flag: str = "--model_name", **options) -> Built:
    """``options`` go to the family's constructor (SD: prediction_type; FLUX: objective overrides)."""
    options = {k: v for k, v in options.items() if v is not None}
    if name_or_path in PRESETS:
        spec = get_preset(name_or_path)
        cls = FAMILIES[spec["family"]]
        parts = {part: _part_from_config(part_cls, spec[part]) for part, part_cls in cls.PARTS.items()}
        parts["scheduler"] = cls.SCHEDULER.from_config(spec["scheduler"])
        tokenizers = {key: build_tokenizer(spec[folder]) for folder, key in cls.TOKENIZERS.items()}
        if "objective" in spec:
            options["objective"] = {**spec["objective"], **options.get("objective", {})}
        resolution = spec["resolution"]
    else:
        cls = _family_of_dir(name_or_path, flag)
        kw = {"local_files_only": True}
        parts = {part: part_cls.from_pretrained(name_or_path, subfolder=part, **kw)
                 for part, part_cls in cls.PARTS.items()}
        parts["scheduler"] = cls.SCHEDULER.from_pretrained(name_or_path, subfolder="scheduler", **kw)
        tokenizers = {key: AutoTokenizer.from_pretrained(os.path.join(name_or_path, folder), **kw)
                      for folder, key in cls.TOKENIZERS.items()
                      if os.path.isdir(os.path.join(name_or_path, folder))}
        resolution = describe(name_or_path, flag).resolution
    if tokenizer_path is not None:
        if not os.path.isdir(tokenizer_path):
            raise UsageError(f"--tokenizer: directory {tokenizer_path!r} does not exist; pass a local "
                             "tokenizer directory (e.g. the 'tokenizer' folder of a diffusers pipeline)")
        first_key = next(iter(cls.TOKENIZERS.values()))
        tokenizers[first_key] = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    model = cls(**parts, encoder_dtype=encoder_dtype, **options)
    return Built(model=model, tokenizers=tokenizers, family=_family_name(cls), resolution=resolution)


def _family_name(cls: type) -> str:
    return next(k for k, v in FAMILIES.items() if v is cls)
