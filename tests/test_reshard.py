"""Resume on another number of ranks (issue 35 part 2): a sharded (FSDP2) checkpoint saved by 2 ranks resumes on
4, one saved by 4 on 2, and one saved by 2 goes on on one rank without FSDP (converted once to a checkpoint file:
checkpointing.local.unsharded). Each starts from bitwise the state the checkpoint holds (weights, AdamW's moments and
steps, EMA), keeps the global batch, and reads the rest of the epoch, and the next, in the uninterrupted run's
order: every global batch holds the same samples, none seen twice or skipped. The weights after the resumed
batches are not compared: each rank draws the noise and timesteps of its own samples, so another world size
draws other noise (docs/reliability.md). sd-tiny on 32 MDS images, a global batch of 8 (4 batches an epoch),
6 batches, resumed from batch 2 (4 -> 2: from batch 3); tests/reshard_worker.py runs and records each."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO, composer_launcher

BATCHES, RESUME_AT = 6, 2
WORKER = str(REPO / "tests" / "reshard_worker.py")


def _launch(ranks: int, out, *runs, cwd) -> str:
    """The worker on ``ranks`` ranks (one: plain python, as a user left with one GPU runs train.py), doing each
    (folder, mds) run to BATCHES; its whole output."""
    args = [str(a) for folder, mds in runs for a in (folder, mds, BATCHES)]
    launcher = [sys.executable] if ranks == 1 else [composer_launcher(), "-n", str(ranks)]
    done = subprocess.run([*launcher, WORKER, str(out), *args], cwd=cwd, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    return output


def _stopped_at(folder, into, at: int = RESUME_AT):
    """A save folder holding only ``folder``'s sharded checkpoint of batch ``at``: as a run stopped there leaves
    it, for a run on another number of ranks to resume."""
    into.mkdir()
    shutil.copytree(folder / f"ep0-ba{at}", into / f"ep0-ba{at}")
    return into


def _ids(out) -> dict[int, list[int]]:
    return {int(k): v for k, v in json.loads((out / "ids.json").read_text()).items()}


def _assert_same_order(straight: dict, resumed: dict, at: int = RESUME_AT) -> None:
    """The run resumed at batch ``at`` read the uninterrupted run's global batches after it, each with the same
    samples; the first epoch (4 batches of 8 of the 32 samples) has each sample once, the second epoch too."""
    assert sorted(resumed) == list(range(at + 1, BATCHES + 1))
    assert {b: resumed[b] for b in resumed} == {b: straight[b] for b in resumed}
    epoch = [i for b in range(1, at + 1) for i in straight[b]] + [i for b in range(at + 1, 5) for i in resumed[b]]
    assert sorted(epoch) == list(range(32))
    assert len(set(resumed[5] + resumed[6])) == 16


def _assert_starts_from(out, checkpoint: dict, at: int = RESUME_AT) -> None:
    """The run started from bitwise the checkpoint's weights, AdamW state and EMA average, at its batch."""
    loaded = torch.load(out / "loaded.pt", weights_only=True)
    state = checkpoint["state"]
    assert loaded["batch"] == at
    model, optim = state["model"], state["optimizers"]["AdamW"]["state"]
    ema = state["callbacks"]["EMA"]["ema"]
    assert loaded["model"] and loaded["model"].keys() <= model.keys()
    assert [n for n in loaded["model"] if not torch.equal(loaded["model"][n], model[n])] == []
    assert loaded["optim"].keys() == loaded["model"].keys()
    assert [(n, k) for n, s in loaded["optim"].items() for k in s if not torch.equal(s[k], optim[n][k])] == []
    assert loaded["ema"].keys() == loaded["model"].keys()
    assert [n for n in loaded["ema"] if not torch.equal(loaded["ema"][n], ema[n])] == []
    # the sample order's parameter reached the dataset (its resume state) and the run config
    assert state["dataset_state"]["train"]["num_canonical_nodes"] == 2
    assert state["callbacks"]["RunConfig"]["config"]["num_canonical_nodes"] == 2


def _sharded(folder, at: int = RESUME_AT) -> dict:
    from diffusion.checkpointing.local import read_sharded

    return read_sharded(str(folder / f"ep0-ba{at}"))


@pytest.fixture(scope="module")
def on_two(tmp_path_factory, mds_images):
    """2 ranks, fsdp=true, uninterrupted to BATCHES (a sharded checkpoint every batch)."""
    root = tmp_path_factory.mktemp("reshard")
    _launch(2, root / "two", (root / "A", mds_images), cwd=root)
    return root


@pytest.fixture(scope="module")
def on_four(on_two, mds_images):
    """4 ranks, fsdp=true: the 2-rank run's batch-2 checkpoint resumed to BATCHES (its checkpoints from batch 3 on
    are saved by 4 ranks)."""
    root = on_two
    resumed = _stopped_at(root / "A", root / "B")
    return root, _launch(4, root / "four", (resumed, mds_images), cwd=root)


@pytest.mark.slow
def test_sharded_checkpoint_of_two_ranks_resumes_on_four(on_two, on_four):
    root, output = on_four
    _assert_starts_from(root / "four" / "0", _sharded(root / "A"))
    _assert_same_order(_ids(root / "two" / "0"), _ids(root / "four" / "0"))
    # the global batch of 8 is kept (2 a rank), and the line says so; Composer's multi-line RNG warning is not shown
    assert "saved by 2 ranks, now 4: the global batch of 8 is kept (2 a rank)" in output, output[-3000:]
    assert "RNG state" not in output


@pytest.mark.slow
def test_sharded_checkpoint_goes_on_on_one_rank_without_fsdp(on_two, mds_images):
    """A user left with one GPU: the same save folder, fsdp=false, one process. The sharded folder is converted
    once into the file a run without FSDP would have saved at that batch, latest names it, and the run goes on
    from it, saving checkpoint files."""
    root = on_two
    resumed = _stopped_at(root / "A", root / "E")
    output = _launch(1, root / "one", (resumed, mds_images), cwd=root)
    name = f"ep0-ba{RESUME_AT}"
    assert f"checkpoint: {name} is sharded (FSDP) and this run has no FSDP: converted to {name}-rank0.pt" in output
    assert f"resuming from {resumed}/{name}-rank0.pt (batch {RESUME_AT} of {BATCHES}" in output, output[-3000:]
    assert "saved by 2 ranks, now 1: the global batch of 8 is kept (8 a rank)" in output
    assert "is not in the state_dict" not in output and "RNG state" not in output
    _assert_starts_from(root / "one" / "0", _sharded(root / "A"))
    _assert_same_order(_ids(root / "two" / "0"), _ids(root / "one" / "0"))
    assert (resumed / "latest-rank0.pt").resolve() == resumed / f"ep1-ba{BATCHES}-rank0.pt"


@pytest.mark.slow
def test_load_path_of_a_sharded_folder_without_fsdp_starts_from_its_state(on_two, mds_images, tmp_path):
    """load_path naming a sharded folder, fsdp=false, in this process (one rank): converted to the file beside it,
    and the run starts at its batch with its weights."""
    from diffusion.config import TrainConfig
    from diffusion.trainer import build_trainer

    folder = _stopped_at(on_two / "A", tmp_path / "F") / f"ep0-ba{RESUME_AT}"
    cfg = TrainConfig(
        model_name="sd-tiny", use_synth_data=False, local=str(mds_images), batch_size=8, num_workers=0, lr=1e-3,
        use_ema=True, eval_interval=None, max_duration=f"{BATCHES}ba", load_path=str(folder), progress="lines",
    )  # fmt: skip
    trainer = build_trainer(cfg)
    try:
        assert int(trainer.state.timestamp.batch) == RESUME_AT
        model = _sharded(on_two / "A")["state"]["model"]
        weights = {n: p for n, p in trainer.state.model.named_parameters() if p.requires_grad}
        assert weights and [n for n, p in weights.items() if not torch.equal(p.detach(), model[n])] == []
        assert (tmp_path / "F" / f"ep0-ba{RESUME_AT}-rank0.pt").is_file()
    finally:
        trainer.close()


def test_load_path_of_a_folder_that_is_no_sharded_checkpoint_is_one_line(tmp_path):
    from diffusion.config import TrainConfig
    from diffusion.errors import UsageError
    from diffusion.trainer import build_trainer

    (tmp_path / "ep0-ba2").mkdir()
    cfg = TrainConfig(model_name="sd-tiny", use_synth_data=True, batch_size=2, num_workers=0,
                      load_path=str(tmp_path / "ep0-ba2"), max_duration="1ba")  # fmt: skip
    with pytest.raises(UsageError, match=r"ep0-ba2 is a directory but not a whole sharded checkpoint \(no \.metadata"):
        build_trainer(cfg)
