from diffusion.models.build import FAMILIES, Built, build_model, describe
from diffusion.models.flux import Flux
from diffusion.models.presets import PRESETS
from diffusion.models.sd import StableDiffusion
from diffusion.models.sdxl import StableDiffusionXL

__all__ = ["FAMILIES", "Built", "build_model", "describe", "Flux", "PRESETS", "StableDiffusion", "StableDiffusionXL"]
