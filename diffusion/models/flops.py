"""FLOP counting by tracing a module on the meta device (no memory, no compute)."""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode


def count_flops(
    cls,
    config,
    *,
    args: Callable[[], tuple],
    train: bool,
    method: str | None = None,
    kwargs: Callable[[], dict] | None = None,
    prepare: Callable[[torch.nn.Module], None] | None = None,
) -> float:
    """FLOPs of one call of a fresh ``cls`` built from ``config`` on ``args()`` (and ``kwargs()``); with
    ``train``, the backward pass too (a scalar sum of the first output is back-propagated). ``prepare`` is given
    the fresh module first (the training techniques installed on the trained one: token routing)."""
    with torch.device("meta"):
        module = cls.from_config(config) if hasattr(cls, "from_config") else cls(config)
        if prepare is not None:
            prepare(module)
        inputs, named = args(), kwargs() if kwargs else {}
        counter = FlopCounterMode(display=False)
        with counter:
            out = (getattr(module, method) if method else module)(*inputs, **named)
            if train:
                _first_tensor(out).float().sum().backward()
    return float(counter.get_total_flops())


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, (tuple, list)):
        return _first_tensor(out[0])
    raise TypeError(f"cannot find a tensor in {type(out).__name__}")


def denoiser_flops(model, args: Callable[[], tuple], kwargs: Callable[[], dict] | None = None) -> float:
    """FLOPs of one training step (forward and backward) of ``model``'s trained part (the first of its family's PARTS)
    on ``args()`` (and ``kwargs()``), the training techniques installed on it installed on the traced copy too."""
    part = getattr(model, next(iter(model.PARTS)))
    return count_flops(type(part), part.config, train=True, prepare=model.prepare_traced, args=args, kwargs=kwargs)


def encode_flops(vae, shape: tuple) -> float:
    """FLOPs of ``vae.encode`` on one image of ``shape`` (channels first, no batch)."""
    return count_flops(type(vae), vae.config, train=False, method="encode", args=lambda: (torch.randn(1, *shape),))
