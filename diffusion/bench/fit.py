"""Which microbatch of a speed target fits a card, from the card's memory: a run that runs out of memory on a
lent GPU costs a minute of a 15-minute lease (microbatch 64 did on the H100, eager, 2026-11-25).

Each target's peak memory is a line in the microbatch, ``fixed + per_image x microbatch`` GiB (CUDA's
max_allocated, as the results line reports it), fitted to the lent GPUs' lines in docs/measured/
(tests/test_perf.py checks every measured point and every out-of-memory run against it). The choice is the
largest of the target's microbatches whose predicted peak stays under HEADROOM of the card: the rest is the
CUDA context, the allocator's cache and fragmentation. A measured target's microbatches stop at the largest that
was measured to fit on some card. A target no lent GPU has run yet has its line counted on the meta device
(diffusion.bench.step_memory, the model of the run's own settings: within 2% of every measured peak), and its
first run measures it.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

from diffusion.errors import UsageError

HEADROOM = 0.9
COUNTED_SIZES = (1, 2, 4, 8, 16)  # a counted target's microbatches
CARDS = {"H100 80 GB": 79.6, "H200 141 GB": 139.0}  # GiB: nvidia-smi's H100 figure, the device tool's H200's


@dataclass(frozen=True)
class Memory:
    fixed: float  # GiB: weights, gradients, optimizer state, EMA, frozen encoders
    per_image: float  # GiB per image of the microbatch, eager
    per_image_compiled: float | None  # with --compile (Inductor keeps fewer activations); None: as eager
    microbatches: tuple[int, ...]  # the sizes to choose from, smallest first
    source: str


MEMORY = {
    "sd2-512-latents": Memory(
        19.6,
        1.175,
        0.742,
        (8, 16, 24, 32, 40, 48, 64),
        "eager 57.2 GiB at 32 (H100), 94.8 at 64 (H200); compiled 67.1 at 64 (H200)",
    ),
    "sd2-256-latents": Memory(
        19.7, 0.3, None, (32, 64, 96, 128, 160, 192, 256), "58.1 GiB at 128 (H100), 96.5 at 256 (H200)"
    ),
    "sd2-512-online": Memory(
        18.6, 1.185, None, (8, 16, 24, 32, 40, 48), "37.6 GiB at 16, 56.5 at 32 (H100), 75.5 at 48 (H200)"
    ),
    # one point only: the split between the fixed part and the images is counted (step_memory: 2.55B trained
    # parameters x 20 bytes, T5-XXL and CLIP in bf16, autocast's bf16 copies; 1.125 GiB per image), 0.8% under it
    "flux-mid-256": Memory(61.4, 1.125, None, (4, 8, 12, 16), "80.0 GiB at 16 (H200); the split counted"),
    # no lent GPU has run these yet: counted on the meta device (step_memory: state + per step, per image), which
    # agrees with every measured line above to 2% (tests/test_step_memory.py)
    **{
        target: Memory(fixed, per_image, None, COUNTED_SIZES, f"counted: {fixed:.1f} GiB + {per_image:.2f} per image")
        for target, fixed, per_image in (
            ("flux2-klein-512-lora", 15.2, 5.61),
            ("sd35-medium-512", 57.3, 4.19),
            ("z-image-512-lora", 19.5, 11.97),
            ("qwen-image-512-lora", 54.7, 11.64),
        )
    },
}


def predicted_gib(target: str, microbatch: int, compiled: bool = False) -> float:
    m = MEMORY[target]
    per_image = m.per_image_compiled if compiled and m.per_image_compiled is not None else m.per_image
    return m.fixed + per_image * microbatch


def microbatch(target: str, card_gib: float, compiled: bool = False) -> int:
    """The largest of ``target``'s microbatches predicted to fit a card of ``card_gib`` GiB."""
    if target not in MEMORY:
        raise UsageError(f"--microbatch fit: no memory figures for {target}; give its microbatch as a number")
    fits = [mb for mb in MEMORY[target].microbatches if predicted_gib(target, mb, compiled) <= HEADROOM * card_gib]
    if not fits:
        smallest = MEMORY[target].microbatches[0]
        raise UsageError(
            f"--microbatch fit: {target} at microbatch {smallest} needs about "
            f"{predicted_gib(target, smallest, compiled):.0f} GiB, more than {HEADROOM:.0%} of this card's "
            f"{card_gib:.1f} GiB; give a microbatch as a number to try anyway"
        )
    return fits[-1]


def card_gib() -> float:
    """The first GPU's memory in GiB: nvidia-smi's figure, which leaves this process without a CUDA context
    (the runs it starts train beside it), else torch.cuda.get_device_properties."""
    if shutil.which("nvidia-smi"):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"], capture_output=True, text=True
        )
        if out.returncode == 0 and out.stdout.strip():
            return float(out.stdout.split()[0]) / 1024
    import torch

    if not torch.cuda.is_available():
        raise UsageError("--microbatch fit: no GPU here to size it for; pass --memory_gib N (80 GB H100: 79.6)")
    return torch.cuda.get_device_properties(0).total_memory / 2**30
