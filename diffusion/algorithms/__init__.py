from diffusion.algorithms.ema import EMA, ema_in_checkpoint, find_ema

__all__ = ["EMA", "ema_in_checkpoint", "find_ema"]
