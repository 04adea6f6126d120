from diffusion.data.loaders import build_eval_dataloader, build_train_dataloader

__all__ = ["build_eval_dataloader", "build_train_dataloader"]
