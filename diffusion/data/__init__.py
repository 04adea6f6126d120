"""Data: synthetic and MDS datasets, loaders, and the converters behind data.py (imported lazily, so the
data CLI does not load the model stack for commands that do not need it)."""

__all__ = ["DataSettings", "build_eval_dataloader", "build_train_dataloader"]


def __getattr__(name: str):
    if name in __all__:
        from diffusion.data import loaders

        return getattr(loaders, name)
    raise AttributeError(f"module 'diffusion.data' has no attribute {name!r}")
