"""The EMA's averaged weights as a checkpoint holds them, and putting them into a model.

The pure part of EMA that reading a finished run needs: ``callbacks/ema.py`` (the callback that keeps the
average during training) saves its state under ``EMA_STATE``, and ``eval/trained_model.py`` applies the
saved average to a rebuilt model, without importing the callback (eval sits below callbacks).
"""

from __future__ import annotations

import torch

EMA_STATE = "ema"  # the key of the averaged weights in the EMA callback's state (Composer saves it as "EMA")


def ema_in_checkpoint(checkpoint_state: dict) -> dict[str, torch.Tensor] | None:
    """The averaged weights stored in a loaded checkpoint's ``state``, or None."""
    return checkpoint_state.get("callbacks", {}).get("EMA", {}).get(EMA_STATE)


@torch.no_grad()
def load_averaged_weights(model: torch.nn.Module, ema: dict[str, torch.Tensor]) -> None:
    """Copy the averaged weights into ``model``'s parameters of the same names (DTensors gathered whole)."""
    params = dict(model.named_parameters())
    for name, value in ema.items():
        params[name].copy_(value.full_tensor() if hasattr(value, "full_tensor") else value)
