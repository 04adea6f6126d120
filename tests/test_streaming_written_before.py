"""Data written by mosaicml-streaming 0.13 (the pinned set before the maintained fork, streaming-community) reads with
the venv's Streaming: the MDS shards of tests/data/streaming-0.13 (made once with 0.13 by its make.py) give the same
samples in the same shuffled order, and a mid-epoch resume state saved by 0.13 continues with the same next samples,
as a checkpoint's dataloader state does when a run moves to the new install."""

import json
import shutil

import numpy as np
from conftest import REPO
from PIL import Image

FIXTURE = REPO / "tests" / "data" / "streaming-0.13"


def test_shards_and_a_resume_state_written_by_streaming_0_13_read_the_same(tmp_path):
    from streaming import StreamingDataset

    from diffusion.data.shared_memory import registering

    record = json.loads((FIXTURE / "resume.json").read_text())
    assert record["streaming"] == "0.13.0"
    local = shutil.copytree(FIXTURE / "mds", tmp_path / "mds")
    options = dict(local=str(local), **record["options"])

    with registering():  # as the project makes its datasets: another test process may be making one
        dataset = StreamingDataset(**options)
    samples = list(dataset)
    assert [int(s["i"]) for s in samples] == record["epoch_order"]
    first = samples[0]
    assert isinstance(first["image"], Image.Image) and np.asarray(first["image"]).shape == (8, 8, 3)
    assert first["caption"] == f"sample {record['epoch_order'][0]}"

    with registering():
        resumed = StreamingDataset(**options)
    resumed.load_state_dict(record["resume_state"])
    assert [int(s["i"]) for s in resumed] == record["after_resume"]
