"""One rank of a 2-rank job that ends through diffusion.cli.run as every entry point does; started by
tests/test_rank_exit.py with the launcher's environment (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_*).

    python tests/exit_worker.py MODE DIST_TIMEOUT_S

MODE ``gather``: gather metric states as torchmetrics' sync does (FID/CLIP in evaluate.py), print
``done rank R`` and return 0. ``stuck``: the same, then rank 0 goes on working (sleeps) while rank 1 is done."""

import sys
import time

import torch
from composer.utils import dist
from torchmetrics.utilities.distributed import gather_all_tensors

from diffusion.cli import run


def main(argv) -> int:
    mode, timeout = argv[0], float(argv[1])
    dist.initialize_dist("cpu", timeout=timeout)
    rank = dist.get_global_rank()
    for size in (2048, 64, 1):  # features, sums, counts: uneven sizes, as metric states are
        gathered = gather_all_tensors(torch.randn(size + rank, 64))
        assert len(gathered) == dist.get_world_size()
    print(f"done rank {rank}", flush=True)
    if mode == "stuck" and rank == 0:
        time.sleep(600)
    return 0


if __name__ == "__main__":
    sys.exit(run("exit_worker.py", main, sys.argv[1:]))
