"""The model families, their presets and the builder. Each name below is imported on first use (PEP 562), so that
``diffusion.models.presets`` (data, standard library only) is read without torch: export.py checks a preset's
name before the heavy imports."""

import importlib

_HOME = {
    "FAMILIES": "build",
    "Built": "build",
    "build_model": "build",
    "describe": "build",
    "Flux": "flux",
    "PRESETS": "presets",
    "StableDiffusion": "sd",
    "StableDiffusionXL": "sdxl",
}
__all__ = list(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
