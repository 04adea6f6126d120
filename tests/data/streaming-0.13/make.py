"""How this folder was made, once, with mosaicml-streaming 0.13.0 (the pinned set before issue 64): an MDS dataset of
24 image-caption samples (8x8 JPEGs) in 2 shards, and a mid-epoch resume state with the samples that follow it.
tests/test_data_loading.py reads both with whatever Streaming the venv has (the maintained fork since). Not run by
the tests: run again, it would write what the venv's Streaming writes.

    python tests/data/streaming-0.13/make.py
"""

import json
from pathlib import Path

import numpy as np
import streaming
from PIL import Image
from streaming import MDSWriter, StreamingDataset

HERE = Path(__file__).parent
SAMPLES, SEED, CONSUMED = 24, 17, 9


def write() -> None:
    rng = np.random.default_rng(0)
    with MDSWriter(
        out=str(HERE / "mds"), columns={"image": "jpeg", "caption": "str", "i": "int"}, size_limit=4096
    ) as w:
        for i in range(SAMPLES):
            image = Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8))
            w.write({"image": image, "caption": f"sample {i}", "i": i})


def order(dataset, state=None) -> list[int]:
    if state is not None:
        dataset.load_state_dict(state)
    return [int(sample["i"]) for sample in dataset]


if __name__ == "__main__":
    write()
    options = dict(local=str(HERE / "mds"), shuffle=True, shuffle_seed=SEED, batch_size=3, num_canonical_nodes=1)
    whole = order(StreamingDataset(**options))
    dataset = StreamingDataset(**options)
    samples = iter(dataset)
    consumed = [int(next(samples)["i"]) for _ in range(CONSUMED)]  # what a run had read when it saved
    state = dataset.state_dict(num_samples=CONSUMED, from_beginning=True)
    assert consumed == whole[:CONSUMED], (whole, consumed)
    rest = order(StreamingDataset(**options), state)
    assert rest == whole[CONSUMED:], (whole, rest)
    record = {"streaming": streaming.__version__, "options": {k: v for k, v in options.items() if k != "local"}}
    record.update(epoch_order=whole, resume_state=state, after_resume=rest)
    (HERE / "resume.json").write_text(json.dumps(record, indent=1) + "\n")
