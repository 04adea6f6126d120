"""Every family's tiny preset trained for 20 batches on synthetic data from the same seed gives the losses recorded
here: the guard for changes that must not change behaviour (issue 65: a model family is one file). One table per
torch release the suite runs on (the pinned set's 2.7 and the current set's); on another release the test skips.

    python tests/test_family_losses.py     # records this stack's losses (tests/data/family-losses.json), after a
                                           # change that is meant to change them
"""

import json
import sys
from pathlib import Path

import pytest
import torch

# Losses differ between machines in the last digits (CPU kernels); a change of behaviour moves them by far more.
RELATIVE = 1e-3
SETTINGS = {"use_synth_data": True, "batch_size": 2, "max_duration": "20ba", "num_workers": 0, "eval_interval": None,
            "progress": "lines", "lr": 1e-3, "warmup": "0ba"}  # fmt: skip
PRESETS = ("sd-tiny", "sdxl-tiny", "flux-tiny", "sd3-tiny", "flux2-tiny", "flux2-dev-tiny", "z-image-tiny",
           "qwen-image-tiny", "krea2-tiny", "flux3-tiny", "qwen-image-21-tiny", "vae-tiny", "vae-flux2-tiny", "vae-qwen-image-tiny")  # fmt: skip
# {torch release: {preset: losses}}: the pinned set's recorded 2026-12-02 on the 2-core VM (torch 2.7.0, diffusers 0.42.1,
# transformers 5.5.4), the current set's the same day (torch 2.15.0, diffusers 0.42.1, transformers 5.23).
RECORDED = Path(__file__).parent / "data" / "family-losses.json"
LOSSES = json.loads(RECORDED.read_text())


def losses(preset: str) -> list[float]:
    """The 20 training losses of ``preset`` under SETTINGS, from Composer's own log of them."""
    from composer.loggers import InMemoryLogger

    import diffusion.trainer
    from diffusion.config import TrainConfig, check_settings

    memory = InMemoryLogger()
    loggers = diffusion.trainer.loggers
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(diffusion.trainer, "loggers", lambda cfg: [*loggers(cfg), memory])
        diffusion.trainer.fit(check_settings(TrainConfig(model_name=preset, **SETTINGS)))
    return [float(value) for _, value in memory.data["loss/train/total"]]


def release() -> str:
    return ".".join(torch.__version__.split(".")[:2])


@pytest.mark.parametrize("preset", PRESETS)
def test_twenty_batches_give_the_recorded_losses(preset):
    if preset not in LOSSES.get(release(), {}):  # a family added since this stack's table was recorded
        pytest.skip(
            f"no losses of {preset} recorded for torch {release()} (python tests/test_family_losses.py records them)"
        )
    got = losses(preset)
    assert got == pytest.approx(LOSSES[release()][preset], rel=RELATIVE), got


if __name__ == "__main__":
    recorded = {preset: [float(f"{v:.6g}") for v in losses(preset)] for preset in (sys.argv[1:] or PRESETS)}
    LOSSES[release()] = {**LOSSES.get(release(), {}), **recorded}  # the presets named: theirs replaced, the rest kept
    RECORDED.write_text(
        "{\n"
        + ",\n".join(
            f" {json.dumps(r)}: {{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in t.items()) + "\n }"
            for r, t in LOSSES.items()
        )
        + "\n}\n"
    )
    print(f"{RECORDED}: torch {release()}'s losses recorded")
