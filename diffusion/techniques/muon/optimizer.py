"""Muon (momentum orthogonalised by Newton-Schulz) for a denoiser's hidden weight matrices, AdamW for the rest,
in one optimizer (Composer steps one): ``optimizer=muon``.

The Muon update is torch.optim.Muon's (torch >= 2.9; the pinned torch 2.7 has none): Nesterov momentum, five
quintic Newton-Schulz iterations in bf16 with Keller Jordan's coefficients, decoupled weight decay, and the
update scaled by 0.2 * sqrt(max(rows, columns)) so that its RMS matches AdamW's and a recipe's learning rate
carries over (Moonlight, "Muon is Scalable for LLM Training", 2025; torch's ``adjust_lr_fn="match_rms_adamw"``).
Two additions: a convolution kernel is orthogonalised as its (out, in * kh * kw) matrix, and a weight sharded by
FSDP2 (a DTensor) is orthogonalised whole: every rank gathers the full momentum matrix, orthogonalises it and
keeps its own shard of the result, so sharded and unsharded runs take the same step.

Which weights are hidden matrices is the family's rule (``Family.MUON_EXCLUDE``: the trained part's input and
output projections and embeddings stay with AdamW, as do all 1-D weights: biases and norms).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

# torch.optim.Muon's defaults (Keller Jordan's Muon post)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7


def orthogonalise(matrix: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """The Newton-Schulz zeroth power of a 2-D matrix (about U V^T of its SVD), in bf16: torch.optim.Muon's."""
    a, b, c = NS_COEFFICIENTS
    x = matrix.to(dtype=torch.bfloat16, copy=True)
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=NS_EPS))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def muon_update(momentum: torch.Tensor, steps: int = NS_STEPS) -> tuple[torch.Tensor, float]:
    """(orthogonalised update shaped like ``momentum``, its AdamW-matching scale); a DTensor is gathered,
    orthogonalised whole and handed back as this rank's shard."""
    full = momentum.full_tensor() if isinstance(momentum, DTensor) else momentum
    rows, cols = full.shape[0], full[0].numel()
    update = orthogonalise(full.reshape(rows, cols), steps).reshape(full.shape)
    if isinstance(momentum, DTensor):  # every rank holds the same full update: keep this rank's shard, no traffic
        update = distribute_tensor(update, momentum.device_mesh, momentum.placements, src_data_rank=None)
    return update, 0.2 * math.sqrt(max(rows, cols))


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon over ``matrices``, AdamW over ``others``; lr, weight decay and the schedule are shared."""

    def __init__(
        self,
        matrices: list[torch.nn.Parameter],
        others: list[torch.nn.Parameter],
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        momentum: float = 0.95,
        eps: float = 1e-8,
    ):
        groups = [{"params": matrices, "muon": True}, {"params": others, "muon": False}]
        defaults = {"lr": lr, "weight_decay": weight_decay, "betas": betas, "momentum": momentum, "eps": eps}
        super().__init__([g for g in groups if g["params"]], defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    (self._muon_step if group["muon"] else self._adamw_step)(p, self.state[p], group)
        return loss

    @staticmethod
    def _muon_step(p: torch.Tensor, state: dict, group: dict) -> None:
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buf, mu = state["momentum_buffer"], group["momentum"]
        buf.lerp_(p.grad, 1 - mu)
        update, scale = muon_update(p.grad.lerp(buf, mu))  # Nesterov
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(update.to(p.dtype), alpha=-group["lr"] * scale)

    @staticmethod
    def _adamw_step(p: torch.Tensor, state: dict, group: dict) -> None:
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        step, (beta1, beta2), lr = state["step"].item(), group["betas"], group["lr"]
        p.mul_(1 - lr * group["weight_decay"])
        state["exp_avg"].lerp_(p.grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2**step)).add_(group["eps"])
        p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1**step))


def split_for_muon(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(hidden weight matrices, everything else) among the trainable parameters: a matrix is a weight of 2 or
    more dimensions of the trained part, outside the family's MUON_EXCLUDE modules."""
    part = next(iter(model.PARTS))
    exclude = tuple(name + "." for name in model.MUON_EXCLUDE)
    matrices, others = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        inner = name[len(part) + 1 :] if name.startswith(part + ".") else None
        hidden = inner is not None and p.ndim >= 2 and not inner.startswith(exclude)
        (matrices if hidden else others).append(p)
    return matrices, others
