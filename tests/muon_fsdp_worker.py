"""Run under `composer -n 2 tests/muon_fsdp_worker.py CHECKPOINT_DIR`: (1) a weight matrix sharded by FSDP2 takes
the same Muon step as its unsharded copy (it is orthogonalised whole, not per shard); (2) sd-tiny trained with
fsdp=true optimizer=muon for 1 batch, saved sharded, resumed by a new trainer to 2, ends bitwise where an
uninterrupted 2-batch run ends. Exit code 0 and "MUON-FSDP-OK" on rank 0 mean it held."""

import copy
import sys

import torch
from composer.utils import dist
from fsdp_resume import assert_resumes_bitwise, full
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from diffusion.cli import run
from diffusion.techniques.muon.optimizer import MuonWithAdamW


def sharded_step_equals_unsharded() -> float:
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Linear(40, 16))
    sharded = copy.deepcopy(plain)
    for layer in sharded:
        fully_shard(layer)
    fully_shard(sharded)
    assert isinstance(sharded[0].weight, DTensor) and sharded[0].weight.to_local().shape[0] == 20
    opts = []
    for model in (plain, sharded):
        weights = [m.weight for m in model]
        opts.append(MuonWithAdamW(weights, [m.bias for m in model], lr=0.02, weight_decay=0.1, betas=(0.9, 0.99)))
    x = torch.randn(8, 24, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        for model, opt in zip((plain, sharded), opts):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    return max((full(b) - a).abs().max().item() for a, b in zip(plain.parameters(), sharded.parameters()))


def main():
    root = sys.argv[1]
    assert_resumes_bitwise(root, {"model_name": "sd-tiny", "optimizer": "muon"})
    err = sharded_step_equals_unsharded()  # after the trainers: Composer has set up the process group
    assert err < 1e-5, f"the sharded Muon step differs from the unsharded one by {err}"
    if dist.get_global_rank() == 0:
        print(f"MUON-FSDP-OK sharded_vs_unsharded={err:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run("muon_fsdp_worker.py", lambda _argv: main()))
