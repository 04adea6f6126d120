from diffusion.algorithms.ema import EMA

__all__ = ["EMA"]
