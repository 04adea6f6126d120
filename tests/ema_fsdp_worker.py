"""Run under `composer -n 2 tests/ema_fsdp_worker.py CHECKPOINT_DIR`: FSDP2-sharded training with EMA and
an evaluation after the last batch; checks the sharded average against a hand computation from full
(gathered) weight snapshots, that eval ran on the averaged weights, that the live weights came back, and
that autoresuming from a sharded checkpoint restores every rank's share of the average. Exit code 0 and
"EMA-FSDP-OK" on rank 0 mean it held."""

import sys

from composer.core import Callback
from composer.utils import dist
from torch.distributed.tensor import DTensor

from diffusion.callbacks.ema import find_ema
from diffusion.cli import run
from diffusion.config import TrainConfig
from diffusion.trainer import build_trainer


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


class Snapshots(Callback):
    """Full copies of the trainable weights at fit start and after every batch (callbacks run after
    the EMA callback, so these are the weights the EMA just averaged in)."""

    def __init__(self):
        self.snaps = []

    def _take(self, state):
        self.snaps.append(
            {n: full(p.detach()).double().clone() for n, p in state.model.named_parameters() if p.requires_grad}
        )

    def fit_start(self, state, logger):
        self._take(state)

    def batch_end(self, state, logger):
        self._take(state)

    def eval_batch_start(self, state, logger):
        if len(self.snaps) == 4:  # first eval batch after the 3 training batches
            self._take(state)


def main():
    smoothing = 0.6
    cfg = TrainConfig(
        model_name="sd-tiny",
        use_synth_data=True,
        batch_size=4,
        max_duration="3ba",
        use_ema=True,
        ema_smoothing=smoothing,
        fsdp=True,
        num_workers=0,
        lr=1e-2,
        eval_interval="3ba",
        eval_samples=8,
        save_folder=sys.argv[1],
        save_interval="3ba",
    )
    trainer = build_trainer(cfg)
    snap = Snapshots()
    trainer.state.callbacks.append(snap)
    trainer.fit()
    ema = find_ema(trainer.state)
    assert ema.num_updates == 3, ema.num_updates
    sharded = [t for t in ema.ema.values() if isinstance(t, DTensor)]
    assert len(sharded) == len(ema.ema), "EMA tensors must be sharded like the FSDP2 parameters"
    assert any(t.to_local().numel() < t.numel() for t in sharded), "nothing is actually sharded"
    assert len(snap.snaps) == 5, len(snap.snaps)  # start, 3 batches, eval
    at_eval = snap.snaps.pop()
    expected = snap.snaps[0]
    for step in snap.snaps[1:]:
        expected = {n: smoothing * expected[n] + (1 - smoothing) * step[n] for n in expected}
    worst = max((full(ema.ema[n]).double() - expected[n]).abs().max().item() for n in expected)
    moved = max((snap.snaps[-1][n] - expected[n]).abs().max().item() for n in expected)
    assert worst < 1e-5, f"sharded EMA differs from the hand computation by {worst}"
    assert moved > 1e-4, "EMA equals the live weights: it is not averaging"
    eval_err = max((at_eval[n] - expected[n]).abs().max().item() for n in expected)
    assert eval_err < 1e-5, f"evaluation did not run on the EMA weights (off by {eval_err})"
    live = {n: full(p.detach()).double() for n, p in trainer.state.model.named_parameters() if p.requires_grad}
    back = max((live[n] - snap.snaps[-1][n]).abs().max().item() for n in expected)
    assert back < 1e-6, f"live weights not restored after evaluation (off by {back})"
    saved = {n: full(t).clone() for n, t in ema.ema.items()}
    trainer.close()

    # A new trainer autoresuming from the sharded checkpoint gets every rank's share of the average back (and
    # rank 0 says where it resumed from: tests/test_ema.py reads the line).
    cfg.autoresume, cfg.eval_interval = True, None
    again = build_trainer(cfg)
    restored = find_ema(again.state)
    assert restored.num_updates == 3, restored.num_updates
    lost = max((full(restored.ema[n]) - saved[n]).abs().max().item() for n in saved)
    assert lost == 0, f"EMA restored from the sharded checkpoint differs by {lost}"
    again.close()
    if dist.get_global_rank() == 0:
        print(f"EMA-FSDP-OK max_err={worst:.2e} ema_vs_live={moved:.2e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run("ema_fsdp_worker.py", lambda _argv: main()))  # ends each rank as every entry point does
