"""Exponential moving average of the trainable weights, as a Composer callback.

Generic: it averages whatever ``model.named_parameters()`` yields with ``requires_grad`` (the denoiser
of any family; frozen encoders are skipped), in fp32, with one fused ``_foreach_lerp_`` per update.
Sharding-correct without gathering anything: under FSDP2 parameters are DTensors and the average is kept
as DTensors of the same layout (each rank averages its own shard); under DDP or one process, plain
tensors. EMA weights are swapped in for evaluation and swapped back afterwards; the training weights in
checkpoints stay the training weights, and the average is saved in this algorithm's state
(``ema_weights.py`` reads it back from a checkpoint).

Why a callback and not an Algorithm: Composer keeps algorithm state as a list of (name, state) tuples,
which torch.distributed.checkpoint pickles whole from rank 0, so in a sharded (FSDP) checkpoint every
other rank's share of the average would be lost. Callback state is a dict, which DCP traverses, saving
and loading each DTensor shard by shard.

Why not composer.algorithms.EMA: besides the above, it gathers full parameters every step under FSDP1,
stores unsharded copies, and also "averages" integer buffers (e.g. CLIP's position_ids), which it then
swaps in at eval.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from composer.core import Callback, State
from composer.loggers import Logger
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from diffusion.checkpointing.ema_weights import EMA_STATE
from diffusion.models.renamed_keys import stored_names


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class EMA(Callback):
    def __init__(self, smoothing: float = 0.9999, update_interval: int = 1):
        if not 0.0 < smoothing < 1.0:
            raise ValueError(f"EMA smoothing must be in (0, 1), got {smoothing}")
        if update_interval < 1:
            raise ValueError(f"EMA update_interval must be >= 1 batch, got {update_interval}")
        self.smoothing = smoothing
        self.update_interval = update_interval
        self.ema: dict[str, torch.Tensor] | None = None
        self.num_updates = 0
        self._model: torch.nn.Module | None = None
        self._fsdp_units: list[torch.nn.Module] | None = None
        self._swapped = False

    # --- storage ------------------------------------------------------------------------------------
    def _params(self) -> dict[str, torch.nn.Parameter]:
        assert self._model is not None
        return {n: p for n, p in self._model.named_parameters() if p.requires_grad}

    def _ensure(self) -> dict[str, torch.Tensor]:
        """Create the average from the current weights (after any sharding) on first use."""
        if self.ema is None:
            with torch.no_grad():
                self.ema = {n: p.detach().float().clone() for n, p in self._params().items()}
        return self.ema

    def _pairs(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        # FSDP2 leaves the root unit's parameters gathered after a forward with no backward (eval), and
        # then named_parameters() yields full tensors: bring every unit back to its shards first.
        if self._fsdp_units is None:  # sharding is applied once, before training: find the units once
            self._fsdp_units = [m for m in self._model.modules() if isinstance(m, FSDPModule)]
        for m in self._fsdp_units:
            m.reshard()
        ema, params = self._ensure(), self._params()
        if ema.keys() != params.keys():
            missing = sorted(params.keys() - ema.keys())[:3] + sorted(ema.keys() - params.keys())[:3]
            raise RuntimeError(
                f"EMA state does not match the model's trainable parameters (e.g. {missing}); "
                "was the checkpoint saved from a different model?"
            )
        names = list(params)
        return [_local(ema[n]) for n in names], [_local(params[n]) for n in names]

    # --- events -------------------------------------------------------------------------------------
    def init(self, state: State, logger: Logger) -> None:
        self._model = state.model

    def fit_start(self, state: State, logger: Logger) -> None:
        self._to_param_devices()

    def batch_end(self, state: State, logger: Logger) -> None:
        if state.timestamp.batch.value % self.update_interval == 0:
            with torch.profiler.record_function("diffusion/ema_update"):  # a named phase of a profile (profile=)
                self.update()

    def eval_start(self, state: State, logger: Logger) -> None:
        if not self._swapped:
            self.swap()

    def eval_end(self, state: State, logger: Logger) -> None:
        if self._swapped:
            self.swap()

    def fit_end(self, state: State, logger: Logger) -> None:
        if self._swapped:
            self.swap()

    @torch.no_grad()
    def update(self) -> None:
        ema, params = self._pairs()
        weight = 1.0 - self.smoothing**self.update_interval
        if any(p.dtype != torch.float32 for p in params):
            params = [p.float() for p in params]
        torch._foreach_lerp_(ema, params, weight)
        self.num_updates += 1

    @torch.no_grad()
    def swap(self) -> None:
        """Exchange the model's trainable weights and the averaged ones (in place, shard by shard)."""
        ema, params = self._pairs()
        for e, p in zip(ema, params):
            live = p.detach().clone()
            p.copy_(e)
            e.copy_(live)
        self._swapped = not self._swapped

    @contextlib.contextmanager
    def averaged_weights(self):
        """Context in which the model holds the EMA weights (for sampling or export)."""
        if self._swapped:
            yield
            return
        self.swap()
        try:
            yield
        finally:
            self.swap()

    def _to_param_devices(self) -> None:
        ema, params = self._ensure(), self._params()
        for n, p in params.items():
            if n in ema and ema[n].device != p.device:
                ema[n] = ema[n].to(p.device)

    # --- checkpoints --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self._swapped:  # never save the averaged and live weights the wrong way round
            self.swap()
        return {
            EMA_STATE: self._ensure() if self._model is not None else self.ema,
            "num_updates": self.num_updates,
            "smoothing": self.smoothing,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state[EMA_STATE]
        if self._model is not None:  # a text encoder's adapters saved under another transformers release's names
            own = {stored: name for name, stored in stored_names(self._model, list(saved)).items()}
            saved = {own.get(n, n): t for n, t in saved.items()}
        if self.ema is None:
            self.ema = {n: t.float() for n, t in saved.items()}
        else:
            with torch.no_grad():  # load into the existing (possibly sharded) tensors
                for n, t in saved.items():
                    if n in self.ema and self.ema[n] is not t:
                        self.ema[n].copy_(t)
        self.num_updates = state.get("num_updates", 0)


def find_ema(state: State) -> EMA | None:
    """The run's EMA callback, if it keeps one."""
    return next((cb for cb in state.callbacks if isinstance(cb, EMA)), None)
