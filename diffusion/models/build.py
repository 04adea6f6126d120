"""Build a model from a preset name or a local diffusers directory.

``build_model(name)`` is the one entry point: a preset (presets/) is built offline with random
weights; a directory (a pipeline, or for the autoencoder family an ``AutoencoderKL`` folder) is loaded
with ``from_pretrained(..., local_files_only=True)``; a Hugging Face id (``org/name[@revision]``) stands
for its snapshot in the local cache (hub_cache.py), for the model, a local part and the tokenizer alike.
Nothing reaches a model hub. Which parts to build, and with which classes, comes from the family's class
attributes. ``local_parts`` swaps parts of a diffusion model for local pretrained ones by pipeline folder
name: ``{"vae": DIR}`` (e.g. exported from an autoencoder run), ``{"text_encoder": DIR}`` (e.g. a CLIP text
tower), ``{"text_encoder_2": DIR}`` (SDXL's second CLIP tower, FLUX's T5), each checked to fit the denoiser;
``tokenizers`` does the same for the tokenizer folders (``{"tokenizer": DIR, "tokenizer_2": DIR}``).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field

import torch
from diffusers import ModelMixin

from diffusion.errors import UsageError, spell
from diffusion.file_checks import check_weights, read_json
from diffusion.models.autoencoder import Autoencoder
from diffusion.models.base import Family, Geometry
from diffusion.models.flux import Flux
from diffusion.models.flux2 import Flux2
from diffusion.models.flux2_dev import Flux2Dev
from diffusion.models.flux3 import Flux3, Flux3Distilled
from diffusion.models.hub_cache import hub_id_to_path
from diffusion.models.krea2 import Krea2
from diffusion.models.presets import PRESETS, get_preset
from diffusion.models.qwen_image import QwenImage
from diffusion.models.qwen_image21 import QwenImage21
from diffusion.models.sd import StableDiffusion
from diffusion.models.sd3 import StableDiffusion3
from diffusion.models.sdxl import StableDiffusionXL
from diffusion.models.tokenizer import build_tokenizer
from diffusion.models.z_image import ZImage

# The family registry: a preset's "family" names its class here. Adding a family is one class (models/base.py:
# Family) and one entry.
FAMILIES: dict[str, type[Family]] = {
    cls.NAME: cls
    for cls in (
        StableDiffusion,
        StableDiffusionXL,
        Flux,
        Autoencoder,
        Flux2,
        StableDiffusion3,
        ZImage,
        QwenImage,
        Flux2Dev,
        Krea2,
        Flux3,
        Flux3Distilled,
        QwenImage21,
    )  # fmt: skip
}


def _trained_class(cls: type[Family], config: dict | None = None) -> type:
    """The class of the family's trained part (the first of PARTS), as ``config`` (its config.json) names it."""
    return cls.part_class(next(iter(cls.PARTS)), config or {})


def _family_named(class_name: str, *, pipeline: bool) -> type[Family] | None:
    """The family whose pipeline class (``pipeline``: a model_index.json names it) or, for a standalone model
    directory, whose one part's class (its config.json names it) is ``class_name``."""
    for cls in FAMILIES.values():
        if (cls.PIPELINE is not None) == pipeline:
            named = cls.PIPELINE if pipeline else _trained_class(cls, {"_class_name": class_name}).__name__
            if class_name == named:
                return cls
    return None


def pipeline_family(pipe, where: str = "source") -> type[Family]:
    """The family of a loaded diffusers pipeline (its class is that family's PIPELINE); another is one line naming
    the pipelines this project knows (``where``: the flag or key that gave it)."""
    cls = _family_named(type(pipe).__name__, pipeline=True)
    if cls is None:
        raise UsageError(
            f"{where}: a {type(pipe).__name__} is no pipeline of a family this project trains; supported: "
            f"{', '.join(c.PIPELINE for c in FAMILIES.values() if c.PIPELINE)}"
        )
    return cls


@dataclass
class Built:
    model: Family
    tokenizers: dict[str, object]  # batch key -> tokenizer that fills it from a caption
    family: str
    resolution: int
    algorithms: list = field(default_factory=list)  # Composer algorithms the run's training techniques added


def family_of_dir(path: str) -> type:
    """The family of a local diffusers pipeline (or standalone model) directory, or a UsageError saying
    what to pass."""
    if not os.path.isdir(path):
        looks_like_path = os.sep in path or path.startswith(".")
        what = (
            f"directory {path!r} does not exist"
            if looks_like_path
            else f"{path!r} is neither a preset nor a local directory"
        )
        raise UsageError(
            f"{spell('model_name')}: {what}. Presets: {', '.join(PRESETS)}; or pass a local diffusers "
            "pipeline directory or a Hugging Face id (org/name) in the local cache (models are never "
            "downloaded)."
        )
    index = pipeline_index(path)
    if index is None:
        standalone = _family_named(_read_config(path).get("_class_name", ""), pipeline=False)
        if standalone is not None:
            return standalone
        raise UsageError(
            f"{spell('model_name')}: {path!r} has no model_index.json; pass a diffusers pipeline directory "
            "(as saved by save_pretrained), an AutoencoderKL directory, or a preset name"
        )
    name = read_json(index, spell("model_name")).get("_class_name", "")
    cls = _family_named(name, pipeline=True)
    if cls is None:
        raise UsageError(
            f"{spell('model_name')}: {path!r} holds a {name or 'unknown'} pipeline; supported: "
            f"{', '.join(c.PIPELINE for c in FAMILIES.values() if c.PIPELINE)}"
        )
    for sub in cls.PARTS:
        if not os.path.isdir(os.path.join(path, sub)):
            raise UsageError(f"{spell('model_name')}: {path!r} lacks the '{sub}' folder a {name} needs")
    return cls


def pipeline_index(path: str) -> str | None:
    """The index file of a pipeline folder: a diffusers pipeline's model_index.json, else a modular pipeline's
    modular_model_index.json (FLUX.3's: diffusers 0.42 has no other pipeline of it); None when it has neither."""
    for name in ("model_index.json", "modular_model_index.json"):
        if os.path.isfile(os.path.join(path, name)):
            return os.path.join(path, name)
    return None


def _read_config(path: str) -> dict:
    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _part_dir(path: str, cls: type, part: str) -> str:
    return path if cls.PIPELINE is None else os.path.join(path, part)


def _local_part_config(part: str, path: str, expected: type) -> dict:
    """The config of a local directory that replaces ``part``, or a UsageError saying what to pass."""
    if not os.path.isdir(path):
        raise UsageError(
            f"{spell(part)}: directory {path!r} does not exist; pass a local {part} directory (the "
            f"{part} folder of a diffusers pipeline, or one saved with save_pretrained)"
        )
    if pipeline_index(path) is not None:
        raise UsageError(
            f"{spell(part)}: {path!r} is a pipeline directory; pass its {part} folder ({os.path.join(path, part)})"
        )
    config = _read_config(path)
    if not config:
        raise UsageError(
            f"{spell(part)}: {path!r} has no readable config.json; pass a directory saved with save_pretrained"
        )
    # diffusers | transformers (transformers 4.57 saves a Qwen2.5-VL's architectures inside its text_config)
    found = config.get("_class_name") or (config.get("architectures") or [None])[0]
    found = found or (_config_value(config, "text_config.architectures") or [None])[0]
    if found != expected.__name__:
        raise UsageError(
            f"{spell(part)}: {path!r} holds {found or 'a model of unknown class'}, not the "
            f"{expected.__name__} this model's {part} is"
        )
    return config


def describe(name_or_path: str, local_parts: dict[str, str] | None = None) -> Geometry:
    """Shape facts read from configs only (no weights built), to validate flags before a slow build.
    ``local_parts``: pipeline folder name -> local directory replacing that part (checked to fit the
    denoiser: a VAE's latent channels, a text encoder's width)."""
    if name_or_path in PRESETS:
        configs = PRESETS[name_or_path]
        cls, resolution = FAMILIES[configs["family"]], configs.get("resolution")
    else:
        path = hub_id_to_path(name_or_path, spell("model_name"))
        cls, resolution = family_of_dir(path), None
        configs = {part: _read_config(_part_dir(path, cls, part)) for part in cls.PARTS}
    takes = cls.denoiser_inputs(configs) if local_parts else {}  # read from the denoiser's config alone
    if local_parts and not takes:
        raise UsageError(
            f"{spell(next(iter(local_parts)))}: {name_or_path} is {cls.DESCRIPTION}, which has no parts to "
            f"replace; to fine-tune a local {_trained_class(cls).__name__}, give its folder "
            "as model_name"
        )
    for part, path in (local_parts or {}).items():
        if part not in takes:
            raise UsageError(f"{spell(part)}: {name_or_path} has no {part} to replace; it takes {', '.join(takes)}")
        config = _local_part_config(part, hub_id_to_path(path, spell(part)), cls.PARTS[part])
        for key, wanted in takes[part].items():
            got = _config_value(config, key)
            if got != wanted:
                raise UsageError(
                    f"{spell(part)}: {path!r} has {key}={got} but {name_or_path}'s denoiser takes {wanted}; "
                    f"use a {part} with {key}={wanted} or a model that takes {got}"
                )
        configs = {**configs, part: config}
    geometry = cls.geometry(configs, resolution)
    geometry.family, geometry.denoiser_config = cls.NAME, dict(configs.get(next(iter(cls.PARTS)), {}))
    return geometry


def _config_value(config: dict, key: str):
    """A config's value at ``key``, a dotted path in a nested config (``text_config.hidden_size``); None if absent."""
    for name in key.split("."):
        config = config.get(name) if isinstance(config, dict) else None
    return config


def _part_from_config(cls: type, config: dict, device: str | None = None) -> torch.nn.Module:
    """A part with fresh random weights, drawn on ``device`` (default: torch's, the CPU)."""
    with torch.device(device) if device else contextlib.nullcontext():
        if issubclass(cls, ModelMixin):
            return cls.from_config(config)
        return cls(cls.config_class(**config))  # transformers


def build_model(
    name_or_path: str,
    *,
    tokenizers: dict[str, str] | None = None,
    encoder_dtype: torch.dtype | None = None,
    local_parts: dict[str, str] | None = None,
    init_device: str | None = None,
    denoiser_dtype: torch.dtype | None = None,
    **options,
) -> Built:
    """``options`` go to the family's constructor (SD: prediction_type; FLUX, autoencoder: objective
    overrides); ``local_parts``: pipeline folder name -> a local directory that replaces that part;
    ``tokenizers``: tokenizer folder name (tokenizer, tokenizer_2) -> a local tokenizer directory;
    ``init_device``: where a preset's random weights are drawn (a GPU draws them in a blink; the CPU
    spends minutes on FLUX's T5-XXL). Parts read from folders are read in their dtype (the frozen ones in
    ``encoder_dtype``, the trained one in ``denoiser_dtype``: lora_base_dtype), so no fp32 copy is held on the way;
    a preset's are drawn in fp32 (the family and install_lora cast them)."""
    options = {k: v for k, v in options.items() if v is not None}
    local_parts = local_parts or {}
    geometry = describe(name_or_path, local_parts)  # checks the directory and the local parts first
    cls = FAMILIES[geometry.family]
    keys = {folder: _tokenizer_key(cls, folder, name_or_path) for folder in tokenizers or {}}  # before the build
    reading = _reading(cls, encoder_dtype, denoiser_dtype)
    preset = name_or_path in PRESETS
    if preset:
        spec = get_preset(name_or_path)
        parts, own = _preset_parts(cls, spec, local_parts, init_device)
    else:
        parts, own = _pretrained_parts(cls, hub_id_to_path(name_or_path, spell("model_name")), local_parts, reading)
    for part, path in local_parts.items():
        folder = hub_id_to_path(path, spell(part))
        check_weights(folder, spell(part))  # a cut copy: one line naming the file, not a traceback
        parts[part] = cls.PARTS[part].from_pretrained(folder, **reading[part])
    for folder, path in (tokenizers or {}).items():
        own[keys[folder]] = _own_tokenizer(cls, folder, path)
    implied = spec.get("objective", {}) if preset else _folder_objective(cls, name_or_path, own)  # a run's overrides
    if implied:
        options["objective"] = {**implied, **options.get("objective", {})}
    model = cls(**parts, encoder_dtype=encoder_dtype, **options)
    model.size_multiple = geometry.downsample_factor  # image sides must be multiples of it (aspect-ratio buckets)
    return Built(
        model=model, tokenizers=cls.caption_tokenizers(own), family=geometry.family, resolution=geometry.resolution
    )


def _folder_objective(cls: type[Family], name_or_path: str, tokenizers: dict) -> dict:
    """The objective values a pretrained folder implies: from its tokenizers and its pipeline index (model_index.json,
    or a modular pipeline's modular_model_index.json)."""
    index = pipeline_index(hub_id_to_path(name_or_path, spell("model_name"))) if cls.PIPELINE is not None else None
    recorded = read_json(index, spell("model_name")) if index else {}
    return {**cls.folder_objective(tokenizers), **cls.pipeline_objective(recorded)}


def _preset_parts(
    cls: type[Family], spec: dict, local_parts: dict[str, str], device: str | None = None
) -> tuple[dict, dict]:
    """(parts, tokenizers) of a preset: random weights from its configs, drawn on ``device``, except the parts
    given locally."""
    parts = {
        part: _part_from_config(cls.part_class(part, spec[part]), spec[part], device)
        for part in cls.PARTS
        if part not in local_parts
    }
    if "scheduler" in spec:
        parts["scheduler"] = cls.SCHEDULER.from_config(spec["scheduler"])
    tokenizers = {key: build_tokenizer(spec[folder]) for folder, key in cls.TOKENIZERS.items()}
    return parts, tokenizers


def _reading(cls: type[Family], encoder_dtype, denoiser_dtype) -> dict[str, dict]:
    """Part -> from_pretrained's keywords for reading it from a folder (the pipeline's or a local part's): offline,
    the frozen parts in encoder_dtype and the trained one in denoiser_dtype, each when given."""
    dtype = {**{part: encoder_dtype for part in cls.FROZEN}, next(iter(cls.PARTS)): denoiser_dtype}
    return {
        part: {"local_files_only": True, **({"torch_dtype": dtype[part]} if dtype.get(part) is not None else {})}
        for part in cls.PARTS
    }


def _pretrained_parts(
    cls: type[Family], path: str, local_parts: dict[str, str], reading: dict[str, dict]
) -> tuple[dict, dict]:
    """(parts, tokenizers) of a local pipeline directory (or hub snapshot), its weight files checked first,
    except the parts given locally; each part read with its ``reading`` keywords (_reading)."""
    kw = {"local_files_only": True}
    for part in cls.PARTS:
        if part not in local_parts:
            check_weights(_part_dir(path, cls, part), spell("model_name"))
    parts = {
        part: cls.part_class(part, _read_config(folder)).from_pretrained(folder, **reading[part])
        for part, folder in ((part, _part_dir(path, cls, part)) for part in cls.PARTS)
        if part not in local_parts
    }
    if cls.PIPELINE is not None and os.path.isdir(os.path.join(path, "scheduler")):  # a modular pipeline saves none
        parts["scheduler"] = cls.SCHEDULER.from_pretrained(path, subfolder="scheduler", **kw)
    tokenizers = {
        key: cls.read_tokenizer(os.path.join(path, folder))
        for folder, key in cls.TOKENIZERS.items()
        if os.path.isdir(os.path.join(path, folder))
    }
    return parts, tokenizers


def _tokenizer_key(cls: type[Family], folder: str, name_or_path: str) -> str:
    """The batch key the model's tokenizer ``folder`` fills, or a UsageError naming the tokenizers it has."""
    if folder not in cls.TOKENIZERS:
        has = f"its tokenizers are {', '.join(cls.TOKENIZERS)}" if cls.TOKENIZERS else "it reads no text"
        raise UsageError(f"{spell(folder)}: {name_or_path} is {cls.DESCRIPTION} with no {folder}; {has}")
    return cls.TOKENIZERS[folder]


def _own_tokenizer(cls: type[Family], folder: str, path: str):
    """The local tokenizer directory ``path`` given for the model's tokenizer ``folder``."""
    path = hub_id_to_path(path, spell(folder))
    if not os.path.isdir(path):
        raise UsageError(
            f"{spell(folder)}: directory {path!r} does not exist; pass a local "
            f"tokenizer directory (e.g. the '{folder}' folder of a diffusers pipeline)"
        )
    return cls.read_tokenizer(path)
