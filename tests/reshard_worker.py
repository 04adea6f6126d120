"""Run under `composer -n N tests/reshard_worker.py OUT FOLDER MDS BATCHES` (or plain `python` for one rank): a
sd-tiny run with EMA on the MDS shards in MDS (num_canonical_nodes=2, not Streaming's default here), a global batch of 8, a checkpoint every batch in FOLDER, autoresume,
and fsdp=true on more than one rank (fsdp=false on one), to BATCHES batches. Rank 0 writes OUT/ids.json (the
sample ids of every global batch it trained, by batch number) and OUT/loaded.pt (the whole state the run started
from: weights, optimizer state and EMA, gathered, by parameter name), which tests/test_reshard.py compares with
the checkpoint and with a run on another number of ranks. More FOLDER MDS BATCHES triples: more runs, each with
its own OUT/<n>/, one after the other in the same job."""

import json
import os
import sys

import torch
from composer.core import Callback
from composer.utils import dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from diffusion.batch import SAMPLE_ID
from diffusion.callbacks.ema import find_ema
from diffusion.cli import run
from diffusion.config import TrainConfig
from diffusion.trainer import build_trainer


def whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


class SampleIds(Callback):
    """The sample ids of each global batch (every rank's, gathered), by batch number (1 for the first)."""

    def __init__(self):
        self.ids: dict[int, list[int]] = {}

    def after_dataloader(self, state, logger):
        mine = state.batch[SAMPLE_ID].tolist()
        self.ids[int(state.timestamp.batch) + 1] = sorted(i for ids in dist.all_gather_object(mine) for i in ids)


def started_from(trainer) -> dict:
    """The whole state a trainer starts from (after its load): weights, AdamW's moments and steps, EMA's average,
    by parameter name; every rank takes part (gathers), rank 0's is complete."""
    state = trainer.state
    optim = get_optimizer_state_dict(
        state.model, state.optimizers[0], options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    ema = find_ema(state)
    return {
        "model": {n: whole(p) for n, p in state.model.named_parameters() if p.requires_grad},
        "optim": {n: {k: whole(v) for k, v in s.items()} for n, s in optim.get("state", {}).items()},
        "ema": {n: whole(t) for n, t in (ema.ema or {}).items()} if ema else {},
        "batch": int(state.timestamp.batch),
    }


def one_run(out: str, folder: str, mds: str, batches: int) -> None:
    cfg = TrainConfig(
        model_name="sd-tiny", use_synth_data=False, local=mds, batch_size=8, num_workers=0, lr=1e-3, num_canonical_nodes=2,
        use_ema=True, ema_smoothing=0.9, fsdp=dist.get_world_size() > 1, eval_interval=None,
        max_duration=f"{batches}ba", save_folder=folder, save_interval="1ba", autoresume=True, progress="lines",
    )  # fmt: skip
    trainer = build_trainer(cfg)
    start = started_from(trainer)
    dataset = trainer.state.train_dataloader.dataset
    dataset.with_index = True  # training batches carry their sample ids (as validation batches do)
    ids = SampleIds()
    trainer.state.callbacks.append(ids)
    trainer.fit()
    trainer.close()
    if dist.get_global_rank() == 0:
        os.makedirs(out, exist_ok=True)
        torch.save(start, os.path.join(out, "loaded.pt"))
        with open(os.path.join(out, "ids.json"), "w") as f:
            json.dump(ids.ids, f)


def main(argv: list[str]) -> int:
    out, runs = argv[0], argv[1:]
    for n in range(0, len(runs), 3):
        folder, mds, batches = runs[n : n + 3]
        one_run(os.path.join(out, str(n // 3)), folder, mds, int(batches))
    return 0


if __name__ == "__main__":
    sys.exit(run("reshard_worker.py", lambda _argv: main(sys.argv[1:])))
