"""Run under `composer -n 2 tests/routing_fsdp_worker.py CHECKPOINT_DIR`: flux-tiny with token routing and fsdp=true
routes inside the FSDP2-wrapped blocks (each sample's kept tokens, their own RoPE), and a run saved sharded after 1
batch and resumed by a new trainer to 2 ends bitwise where an uninterrupted 2-batch run ends. Exit code 0 and
"ROUTING-FSDP-OK" on rank 0 mean it held."""

import sys

from fsdp_resume import worker

from diffusion.techniques.routing.tokens import TokenRouter


def check_routed(trainer) -> None:
    t = trainer.state.model.transformer
    (router,) = [
        h.__self__ for h in t._forward_pre_hooks.values() if isinstance(getattr(h, "__self__", None), TokenRouter)
    ]
    assert type(t.transformer_blocks[0]).__name__.startswith("FSDP"), type(t.transformer_blocks[0])
    # the last training forward routed: 2 samples per rank keep 8 of their 16 image tokens, each with its own RoPE
    assert router.kept.shape == (2, 8) and router.rope[0].shape[:2] == (2, 32 + 8), (router.kept, router.rope[0].shape)


def settings(_argv):
    return {"model_name": "flux-tiny", "routing_share": 0.5, "routing_first": "double.0", "routing_last": "single.0"}


if __name__ == "__main__":
    sys.exit(worker("routing_fsdp_worker.py", "ROUTING-FSDP-OK", settings, inspect=check_routed))
