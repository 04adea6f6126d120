"""The training techniques' plug-in shape (diffusion/techniques/): every one is a section of TrainConfig and a
registry entry, a key of it given while it is off is one line, and the one added to prove the shape (gradient
clipping, diffusers' --max_grad_norm) does what it says in a real run."""

import dataclasses

import pytest
import torch
from composer.core import Callback

from diffusion.config import KEYS, TrainConfig
from diffusion.errors import UsageError
from diffusion.techniques import TECHNIQUES
from diffusion.trainer import build_trainer, check_before_build

RUN = dict(model_name="sd-tiny", use_synth_data=True, batch_size=2, num_workers=0, max_duration="1ba", progress="lines")


def test_every_technique_is_a_section_of_the_run_with_its_switch():
    names = {k.name for k in KEYS}
    for technique in TECHNIQUES:
        keys = {f.name for f in dataclasses.fields(technique.SETTINGS)}
        assert keys <= names, technique.NAME
        assert technique.SWITCH in names and not technique.on(TrainConfig()), technique.NAME


@pytest.mark.parametrize(
    "keys,says",
    [
        ({"lora_alpha": 8.0}, "^--lora_alpha is a LoRA setting; give --lora_rank too"),
        ({"routing_first": "double.1"}, "^--routing_first is set but --routing_share is not"),
        ({"repa_weight": 1.0}, "^--repa_weight is set but --repa_encoder is not"),
        ({"muon_momentum": 0.9}, "^--muon_momentum is a Muon setting; give --optimizer muon too"),
    ],
)
def test_a_techniques_key_without_its_switch_is_one_line(keys, says):
    with pytest.raises(UsageError, match=says):
        check_before_build(TrainConfig(**RUN, **keys), world_size=1, on_gpu=False)


class GradNorm(Callback):
    """The total norm of the gradients the optimizer stepped with (they stay until the next batch zeroes them)."""

    def batch_end(self, state, logger) -> None:
        grads = [p.grad for p in state.model.parameters() if p.grad is not None]
        self.norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()


def _grad_norm_after_one_batch(**keys) -> float:
    trainer, seen = build_trainer(TrainConfig(**RUN, **keys)), GradNorm()
    trainer.state.callbacks.append(seen)
    trainer.fit()
    trainer.close()
    return seen.norm


def test_max_grad_norm_clips_the_total_norm_before_the_step():
    free = _grad_norm_after_one_batch()
    clipped = _grad_norm_after_one_batch(max_grad_norm=free / 10)
    assert clipped == pytest.approx(free / 10, rel=1e-4)


def test_text_encoder_adapters_where_the_pipeline_reads_none_are_one_line():
    cfg = TrainConfig(**{**RUN, "model_name": "flux2-tiny"}, lora_rank=4, lora_text_encoder=True)
    with pytest.raises(
        UsageError, match="^--lora_text_encoder: flux2-tiny is a FLUX.2 .*reads no text encoder adapters"
    ):
        check_before_build(cfg, world_size=1, on_gpu=False)
