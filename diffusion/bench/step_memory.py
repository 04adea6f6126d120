"""A training step's peak GPU memory, counted on the meta device (no GPU, no weights, a second or two): whether a
run fits a card, and at what microbatch, before a lent GPU spends a minute finding out.

    python -m diffusion.bench.step_memory --model_name flux2-klein-4b --image_size 512 --lora_rank 16 \\
        --lora_base_dtype bf16 --encoder_dtype bf16 --use_ema --memory_gib 79.6

    python -m diffusion.bench.step_memory --model_name sd35-large --image_size 1024 --fsdp --gpus 8 --use_ema

The flags are benchmark.py's (a run's settings), ``--memory_gib`` (default: an 80 GB H100's and a 141 GB H200's)
and ``--gpus`` (what ``--fsdp`` shards over). What is counted, on one GPU:

- the state, whatever the microbatch: each trained parameter's weights and gradients at its dtype, AdamW's two
  moments (Muon keeps one for its matrices: an upper bound there), the fp32 EMA copy with ``use_ema``; the frozen
  parts and every buffer at their dtype (a precomputed run's text encoders not, with ``text_encoders_on_cpu``);
  with ``fsdp``, the parts that train divided by ``--gpus`` and two of their blocks whole (sharding.py's units:
  the one computing and the one fetched ahead; not yet checked against a multi-GPU run);
- what the forward pass saves for the backward, under bf16 autocast (the ops CUDA's autocast runs in bf16 take
  bf16 copies, normalisations fp32), with a flash-attention kernel's saved set (the inputs, the output and its
  log-sum-exp; never the attention matrix), counted once per storage; with ``gradient_checkpointing``, each
  block's inputs plus the largest block's own set, recomputed in the backward. Counted at microbatch 1 and 2: the
  difference is per image, the rest (autocast's bf16 copies of the trained weights) per step. A value the model
  reads from its data (a caption's length from its padding) is taken at its largest: every text token counts.

Not counted: the CUDA context, the allocator's cache and fragmentation (fit.HEADROOM leaves 10% for them),
``--compile`` (Inductor keeps fewer activations: the count is eager's), and an online run's encoders' own
activations, freed before the denoiser runs. Checked against every lent GPU's measured peak
(tests/test_step_memory.py): within 2% for SD2-base at 256 and 512 px, precomputed and online, and flux-mid.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from diffusion.cli import Parser, positive, run

GIB = 2**30
# the ops CUDA's autocast runs in bf16 (their saved inputs are bf16 copies), and those it runs in fp32
LOW = (F.linear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose2d, torch.matmul, torch.mm, torch.bmm, torch.baddbmm,
       torch.addmm, torch.einsum, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.bmm)  # fmt: skip
HIGH = (F.layer_norm, F.group_norm, torch.softmax, F.softmax, torch.Tensor.softmax, F.log_softmax, F.mse_loss)


@dataclass(frozen=True)
class Count:
    state_gib: float  # weights, gradients, optimizer moments, EMA, frozen parts
    step_gib: float  # per step whatever the microbatch (autocast's bf16 copies of the trained weights)
    per_image_gib: float  # saved for the backward pass, per image of the microbatch

    def peak_gib(self, microbatch: int) -> float:
        return self.state_gib + self.step_gib + self.per_image_gib * microbatch


def _imported_off_meta() -> None:
    """torchao, imported now if installed: PEFT imports it the first time it wraps a layer (LoRA), and torchao makes
    tensors and reads them back as it is imported, which fails inside the meta-device build below
    ("Cannot copy out of meta tensor"), so the count of a LoRA run failed in a process that had not imported it."""
    import importlib.util

    if importlib.util.find_spec("torchao") is not None:
        import torchao  # noqa: F401


def count(cfg, gpus: int = 1) -> Count:
    """The peak memory of one training step of ``cfg`` (a TrainConfig) on one of ``gpus`` GPUs, by microbatch.
    With ``fsdp`` the parts that train are sharded over the GPUs (sharding.py; frozen parts stay whole on each),
    and a GPU holds two of their blocks whole besides (the one computing, the one FSDP2 fetches ahead)."""
    from diffusion.sharding import outermost_blocks
    from diffusion.trainer import _built_model, check_before_build

    check_before_build(cfg, world_size=gpus, on_gpu=True)  # as a run checks it (and fills routing's span, image_size)
    _imported_off_meta()
    with torch.device("meta"):
        net = _built_model(cfg).model
    held = set(cfg.text_encoders_on_cpu and net.text_encoder_parts() or ())
    state, blocks = 0.0, [0]
    for name, part in net.named_children():
        if name in held:
            continue
        trains = any(p.requires_grad for p in part.parameters())
        shards = gpus if cfg.fsdp and trains else 1
        state += (_state_bytes(part.parameters(), cfg.use_ema) + sum(b.nbytes for b in part.buffers())) / shards
        if shards > 1:
            blocks += [sum(p.nbytes for p in block.parameters()) for block in outermost_blocks(part)]
    state += 2 * max(blocks)  # none unless sharded
    one, two = (_saved_bytes(net, cfg.image_size, n) for n in (1, 2))
    return Count(state / GIB, (2 * one - two) / GIB, (two - one) / GIB)


def _state_bytes(params, ema: bool) -> int:
    """A trained parameter's weights, gradients and AdamW's two moments at its dtype and its fp32 EMA copy; a frozen
    one's weights (buffers beside: SD3's position table is 0.23B numbers)."""
    return sum(p.numel() * (4 * p.element_size() + 4 * ema) if p.requires_grad else p.nbytes for p in params)


def _saved_bytes(net: torch.nn.Module, image_size: int, microbatch: int) -> int:
    """Bytes the forward pass and loss of ``microbatch`` synthetic precomputed samples save for the backward."""
    from torch.utils.data import default_collate

    from diffusion.data.synthetic import SyntheticDataset

    weights = {p.untyped_storage()._cdata for p in net.parameters()}
    data = SyntheticDataset(net.batch_shapes(image_size, True), num_samples=microbatch, pool=microbatch)
    batch = {k: v.to("meta") for k, v in default_collate([data[i] for i in range(microbatch)]).items()}
    saved: dict[int, int] = {}
    recomputed = [0]

    def keep(into: dict[int, int]):
        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage._cdata not in weights:
                into.setdefault(storage._cdata, storage.nbytes())
            return t

        return pack

    def checkpoint(block, *args, **kwargs):  # gradient checkpointing: the inputs kept, the block's set recomputed
        for a in args:
            if isinstance(a, torch.Tensor):
                keep(saved)(a)
        inner: dict[int, int] = {}
        with torch.autograd.graph.saved_tensors_hooks(keep(inner), _same):
            out = block(*args, **kwargs)
        recomputed[0] = max(recomputed[0], sum(inner.values()))
        return out

    with contextlib.ExitStack() as stack:
        for m in net.modules():
            if getattr(m, "gradient_checkpointing", False) and getattr(m, "_gradient_checkpointing_func", None):
                stack.callback(setattr, m, "_gradient_checkpointing_func", m._gradient_checkpointing_func)
                m._gradient_checkpointing_func = checkpoint
        # torch 2.15's rms_norm says bf16 meets fp32 weights as autocast would have it; it runs the same
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
        with torch.autograd.graph.saved_tensors_hooks(keep(saved), _same), _Autocast():
            net.loss(net(batch), batch)
    return sum(saved.values()) + recomputed[0]


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


class _FlashAttention(torch.autograd.Function):
    """What a flash or memory-efficient attention kernel saves: q, k, v, the output, the log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad):
        return tuple(torch.empty_like(t) for t in ctx.saved_tensors[:3])


def _cast(x, dtype: torch.dtype):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.to(dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(y, dtype) for y in x)
    return x


class _Autocast(TorchFunctionMode):
    """CUDA's bf16 autocast on meta tensors (torch.autocast leaves meta tensors alone), above autograd as autocast
    is, so the saved tensors are the casts; flash attention; data-dependent values at their largest."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.item):
            if args[0].is_meta:  # a mask's all() is true; a length is as long as any slice
                if func is torch.Tensor.__bool__:
                    return True
                return 1.0 if args[0].is_floating_point() else 2**62
        if func is F.scaled_dot_product_attention:
            qkv = [*args[:3], *(kwargs[n] for n in ("query", "key", "value")[len(args[:3]) :])]
            return _FlashAttention.apply(*_cast(qkv, torch.bfloat16))
        dtype = torch.bfloat16 if func in LOW else torch.float32 if func in HIGH else None
        if dtype is not None:
            args, kwargs = _cast(args, dtype), {k: _cast(v, dtype) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def largest_microbatch(counted: Count, card_gib: float, headroom: float) -> int:
    """The largest microbatch whose counted peak stays under ``headroom`` of the card (0: not even one)."""
    room = headroom * card_gib - counted.state_gib - counted.step_gib
    return max(0, int(room // counted.per_image_gib)) if counted.per_image_gib > 0 else 0


def parser() -> Parser:
    from diffusion.config import KEYS
    from diffusion.settings import add_flags

    p = Parser("diffusion.bench.step_memory", __doc__, usage="python -m diffusion.bench.step_memory [--KEY VALUE ...]")
    p.add_argument("--memory_gib", type=positive(float), default=None, help="the card's memory (default: H100, H200)")
    p.add_argument("--gpus", type=positive(int), default=1, help="GPUs the run shards over with --fsdp (default 1)")
    add_flags(p, KEYS)  # benchmark.py's flags: a run's settings
    return p


def config(flags: Sequence[str]):
    """The TrainConfig of benchmark.py's ``flags``, checked."""
    return _config(parser().parse_args(flags))


def _config(args):
    from diffusion.config import KEYS, TrainConfig, check_settings
    from diffusion.settings import from_flags

    return check_settings(TrainConfig(**from_flags(args, KEYS)))


def main(argv: Sequence[str] | None = None) -> int:
    from diffusion.bench.fit import CARDS, HEADROOM

    args = parser().parse_args(argv)
    cfg = _config(args)
    counted = count(cfg, args.gpus)
    where = f", a GPU of {args.gpus} sharding it" if cfg.fsdp and args.gpus > 1 else ""
    print(
        f"{cfg.model_name} at {cfg.image_size} px{where}: {counted.state_gib:.1f} GiB of state, "
        f"{counted.step_gib:.1f} per step, {counted.per_image_gib:.2f} per image of the microbatch"
    )
    cards = {f"{args.memory_gib:g} GiB": args.memory_gib} if args.memory_gib else CARDS
    for card, gib in cards.items():
        mb = largest_microbatch(counted, gib, HEADROOM)
        fits = f"microbatch {mb} ({counted.peak_gib(mb):.1f} GiB)" if mb else "not microbatch 1"
        mine = cfg.device_train_microbatch_size
        asked = f"; microbatch {mine}: {counted.peak_gib(mine):.1f} GiB" if mine else ""
        print(f"  {card}: {fits} fits under {HEADROOM:.0%} of {gib:.1f} GiB{asked}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run("diffusion.bench.step_memory", main))
