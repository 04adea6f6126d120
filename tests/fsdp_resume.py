"""For the two-rank FSDP2 workers (run under `composer -n 2`): a run of ``batches`` batches with fsdp=true, and the
check that one saved sharded after 1 batch and resumed by a new trainer to 2 ends bitwise where an uninterrupted
2-batch run ends."""

import sys

import torch
from composer.utils import dist
from torch.distributed.tensor import DTensor

from diffusion.cli import run
from diffusion.config import TrainConfig
from diffusion.trainer import build_trainer


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def trained(folder: str, batches: int, settings: dict, autoresume: bool = False, inspect=None) -> dict:
    """The trainable weights, whole, after ``batches`` batches of a run with ``settings`` saving every batch to
    ``folder``; ``inspect(trainer)`` is called after fit, before close."""
    cfg = TrainConfig(
        use_synth_data=True, batch_size=4, max_duration=f"{batches}ba", fsdp=True, num_workers=0, lr=1e-3,
        eval_interval=None, save_folder=folder, save_interval="1ba", autoresume=autoresume, **settings,
    )  # fmt: skip
    trainer = build_trainer(cfg)
    trainer.fit()
    if inspect is not None:
        inspect(trainer)
    weights = {n: full(p.detach()).clone() for n, p in trainer.state.model.named_parameters() if p.requires_grad}
    trainer.close()
    return weights


def assert_resumes_bitwise(root: str, settings: dict, inspect=None) -> None:
    """Straight to 2 batches, then 1 and resumed to 2 (``inspect`` sees the resumed run's trainer): equal weights."""
    straight = trained(f"{root}/straight", 2, settings)
    trained(f"{root}/resumed", 1, settings)
    resumed = trained(f"{root}/resumed", 2, settings, autoresume=True, inspect=inspect)
    diff = [n for n in straight if not torch.equal(straight[n], resumed[n])]
    assert not diff, f"resumed weights differ from the uninterrupted run's: {diff[:3]}"


def worker(name: str, marker: str, settings, inspect=None) -> int:
    """A worker script's whole body: ``settings(argv)`` (argv: the script's arguments after the checkpoint folder)
    resumes bitwise under ``run`` (one-line errors, the process group left); rank 0 prints ``marker``."""

    def main(argv):
        assert_resumes_bitwise(argv[0], settings(argv[1:]), inspect=inspect)
        if dist.get_global_rank() == 0:
            print(marker, flush=True)
        return 0

    return run(name, lambda _argv: main(sys.argv[1:]))
