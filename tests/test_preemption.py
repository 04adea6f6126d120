"""Preemption on real data: a 2-rank run on MDS shards with loader workers, killed whole (launcher, ranks and
workers, as a Slurm preemption or a node loss does) in the middle of an epoch and again in the middle of the
second epoch, then the same command each time, ends with bitwise the weights and EMA of an uninterrupted run.
(The same on shards in object storage: tests/test_object_store_train.py.)"""

import pytest
from conftest import assert_same_weights, final_state, preemption_cmd, run_or_kill

# 32 samples, global batch 8: 4 batches an epoch; 10 batches span three epochs.
BATCHES = 10


@pytest.mark.slow
def test_killed_mid_epoch_and_in_the_second_epoch_resumes_bitwise(tmp_path, mds_images):
    full = run_or_kill(preemption_cmd(tmp_path / "a", BATCHES, f"local={mds_images}"), tmp_path)
    assert full.returncode == 0, full.stdout[-3000:] + full.stderr[-3000:]

    folder = tmp_path / "b"
    cmd = preemption_cmd(folder, BATCHES, f"local={mds_images}")
    run_or_kill(cmd, tmp_path, kill_when=folder / "ep0-ba2-rank0.pt")  # mid first epoch
    run_or_kill(cmd, tmp_path, kill_when=folder / "ep1-ba6-rank0.pt")  # mid second epoch
    assert not (folder / f"ep2-ba{BATCHES}-rank0.pt").exists()
    again = run_or_kill(cmd, tmp_path)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]

    a, b = final_state(tmp_path / "a", f"ep2-ba{BATCHES}-rank0.pt"), final_state(folder, f"ep2-ba{BATCHES}-rank0.pt")
    assert a["batch"] == b["batch"] == BATCHES
    assert_same_weights(a, b)
