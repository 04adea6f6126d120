"""Run under `composer -n 2 tests/repa_fsdp_worker.py CHECKPOINT_DIR ENCODER_DIR`: flux-tiny with REPA aligned at a
block inside the token-routing span, fsdp=true: the projector is its own FSDP2 unit, the REPA loss is computed on
the kept tokens, and a run saved sharded after 1 batch and resumed by a new trainer to 2 ends bitwise where an
uninterrupted 2-batch run ends. Exit code 0 and "REPA-FSDP-OK" on rank 0 mean it held."""

import sys

from fsdp_resume import worker

from diffusion.techniques.repa.alignment import PROJECTOR


def check_aligned(trainer) -> None:
    model = trainer.state.model
    assert type(getattr(model, PROJECTOR)).__name__.startswith("FSDP"), type(getattr(model, PROJECTOR))
    losses = trainer.state.total_loss_dict
    assert {"loss/train/repa", "loss/train/diffusion", "loss/train/total"} <= set(losses), losses
    assert 0 < losses["loss/train/repa"] < 2, losses


def settings(argv):
    return {
        "model_name": "flux-tiny", "repa_encoder": argv[0], "repa_block": "single.0",
        "routing_share": 0.5, "routing_first": "double.0", "routing_last": "single.1",
    }  # fmt: skip


if __name__ == "__main__":
    sys.exit(worker("repa_fsdp_worker.py", "REPA-FSDP-OK", settings, inspect=check_aligned))
