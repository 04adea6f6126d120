from diffusion.data.loaders import build_train_dataloader

__all__ = ["build_train_dataloader"]
