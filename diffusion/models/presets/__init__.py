"""Named model presets, as data: one module here per family (sd.py, flux.py, ... named as the family's module in
models/), each holding its ``PRESETS`` (the full-size architectures and a tiny one for tests) and the part configs
they share; this package assembles them into one registry, ``PRESETS``, with no list kept by hand (a new family's
module here is found by its file). Standard library only: config.py and export.py read the names without torch.

A preset maps a name to the configs of its parts. Adding an architecture is a new entry, not a new function:
``build.py`` turns any entry into modules. Every preset builds offline with random weights; pretrained weights come
from a local diffusers pipeline directory instead (``--model_name DIR``).

Part keys are the folder names of the matching diffusers pipeline, so a preset and a local pipeline directory
describe a model the same way. Every diffusion preset has:
  family          the family's registry name (build.FAMILIES): "sd", "sdxl", "flux", "sd3", "flux2", "flux2-dev",
                  "z-image", "qwen-image", "krea2", "qwen-image-21", or "vae" (an autoencoder to train: only ``vae``
                  and ``resolution``)
  resolution      native image size in pixels (the default ``--image_size``)
  vae             the autoencoder's diffusers config
  text_encoder    the text encoder's transformers config kwargs (and text_encoder_2, _3 where the pipeline has them)
  tokenizer       {"kind": "clip", "max_length": N}: an offline tokenizer (tokenizer.py: "clip" for CLIP towers,
                  "t5" for T5, "chat" / "qwen-image" for Qwen, "mistral" for FLUX.2 [dev]'s processor,
                  "qwen-image-21" for Qwen-Image 2.1's Qwen3-VL processor)
  scheduler       the sampling scheduler's config (SD's: the DDPM training schedule, prediction_type epsilon or
                  v_prediction)
  unet / transformer   the trained part's diffusers config
  objective       the family's objective section as this architecture trains (e.g. its caption length)
"""

from __future__ import annotations

import copy
import importlib
import pkgutil

PRESETS: dict[str, dict] = {}
for _module in pkgutil.iter_modules(__path__):
    _family = importlib.import_module(f"{__name__}.{_module.name}")
    _twice = sorted(set(PRESETS) & set(_family.PRESETS))
    if _twice:
        raise ValueError(f"presets {_twice} are declared twice (in {_module.name}.py and another module)")
    PRESETS.update(_family.PRESETS)


def get_preset(name: str) -> dict:
    """A deep copy of preset ``name`` (callers may edit it freely)."""
    if name not in PRESETS:
        raise KeyError(name)
    return copy.deepcopy(PRESETS[name])
