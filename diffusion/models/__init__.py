from diffusion.models.build import Built, build_model
from diffusion.models.presets import PRESETS
from diffusion.models.sd import StableDiffusion

__all__ = ["Built", "build_model", "PRESETS", "StableDiffusion"]
