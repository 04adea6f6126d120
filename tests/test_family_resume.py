"""Each transformer family added for issues 51 and 53 trains on two ranks under FSDP2 with EMA, saves a sharded
checkpoint at batch 2 and resumes from it to batch 4, as the issues' commands run it: its blocks' FSDP wrap, its EMA
copy and its sharded state are its own, so each family runs once."""

import pytest
from conftest import composer

FAMILIES = ("sd3-tiny", "flux2-tiny", "qwen-image-tiny", "z-image-tiny", "flux2-dev-tiny")


@pytest.mark.slow
@pytest.mark.parametrize("preset", FAMILIES)
def test_two_ranks_fsdp_ema_save_and_resume(preset, tmp_path):
    args = ["benchmark.py", "--use_synth_data", "--model_name", preset, "--fsdp", "--use_ema", "--batch_size", "4"]
    args += ["--num_workers", "0", "--save_folder", "CK", "--save_interval", "2ba", "--autoresume"]
    first = composer(2, *args, "--max_duration", "2ba", cwd=tmp_path)
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    second = composer(2, *args, "--max_duration", "4ba", cwd=tmp_path)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-4000:]
    assert "autoresume: resuming from CK/ep0-ba2 (batch 2 of 4" in out, out[-4000:]
