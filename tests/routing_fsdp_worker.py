"""Run under `composer -n 2 tests/routing_fsdp_worker.py CHECKPOINT_DIR`: flux-tiny with token routing and fsdp=true
routes inside the FSDP2-wrapped blocks (each sample's kept tokens, their own RoPE), and a run saved sharded after 1
batch and resumed by a new trainer to 2 ends bitwise where an uninterrupted 2-batch run ends. Exit code 0 and
"ROUTING-FSDP-OK" on rank 0 mean it held."""

import sys

import torch
from composer.utils import dist
from torch.distributed.tensor import DTensor

from diffusion.cli import run
from diffusion.config import TrainConfig
from diffusion.models.routing import TokenRouter
from diffusion.trainer import build_trainer


def trained(folder: str, batches: int, autoresume: bool = False):
    cfg = TrainConfig(
        model_name="flux-tiny", use_synth_data=True, batch_size=4, max_duration=f"{batches}ba", fsdp=True,
        num_workers=0, lr=1e-3, eval_interval=None, save_folder=folder, save_interval="1ba", autoresume=autoresume,
        routing_share=0.5, routing_first="double.0", routing_last="single.0",
    )  # fmt: skip
    trainer = build_trainer(cfg)
    trainer.fit()
    t = trainer.state.model.transformer
    (router,) = [
        h.__self__ for h in t._forward_pre_hooks.values() if isinstance(getattr(h, "__self__", None), TokenRouter)
    ]
    assert type(t.transformer_blocks[0]).__name__.startswith("FSDP"), type(t.transformer_blocks[0])
    # the last training forward routed: 2 samples per rank keep 8 of their 16 image tokens, each with its own RoPE
    assert router.kept.shape == (2, 8) and router.rope[0].shape[:2] == (2, 32 + 8), (router.kept, router.rope[0].shape)
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in t.named_parameters()}
    trainer.close()
    return full


def main():
    root = sys.argv[1]
    straight = trained(f"{root}/straight", 2)
    trained(f"{root}/resumed", 1)
    resumed = trained(f"{root}/resumed", 2, autoresume=True)
    diff = [n for n in straight if not torch.equal(straight[n], resumed[n])]
    assert not diff, f"resumed weights differ from the uninterrupted run's: {diff[:3]}"
    if dist.get_global_rank() == 0:
        print("ROUTING-FSDP-OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run("routing_fsdp_worker.py", lambda _argv: main()))
