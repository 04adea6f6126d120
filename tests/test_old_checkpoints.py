"""A checkpoint saved on the pinned set before issue 64 (transformers 4.57.6, diffusers 0.39, mosaicml-streaming 0.13;
tests/data/checkpoint-transformers-4.57, made once by its make.sh) resumes and exports on the venv's stack: the run
goes on from its batch 2 with its weights (its text encoder's under the names this transformers gives them), and the
export is a pipeline diffusers loads and samples from."""

import lzma

import torch
from conftest import FAST, REPO, final_state

import export
import train

FIXTURE = REPO / "tests" / "data" / "checkpoint-transformers-4.57" / "flux-tiny-ep0-ba2-rank0.pt.xz"
LEVEL, BARE = "text_encoder.text_model.", "text_encoder."  # CLIPTextModel's keys on transformers 5.5 and 5.23


def test_a_checkpoint_from_transformers_4_57_resumes_and_exports(tmp_path):
    from diffusers import DiffusionPipeline

    old = tmp_path / "old" / "ep0-ba2-rank0.pt"
    old.parent.mkdir()
    old.write_bytes(lzma.decompress(FIXTURE.read_bytes()))
    before = final_state(old.parent, old.name)
    assert before["batch"] == 2

    new = tmp_path / "new"
    args = [str(REPO / "yamls/flux-tiny-cpu.yaml"), *FAST, "batch_size=2", "max_duration=4ba", "autoresume=false"]
    assert train.main([*args, f"load_path={old}", f"save_folder={new}", "save_interval=4ba"]) == 0
    after = final_state(new, "ep0-ba4-rank0.pt")
    assert after["batch"] == 4
    # the frozen parts are the old checkpoint's, bitwise (CLIPTextModel's names lost their text_model level in
    # transformers 5.23: renamed_keys.py), and the transformer trained on from its old weights, two small steps
    moved = []
    for name, weight in before["model"].items():
        now = name if name in after["model"] else name.replace(LEVEL, BARE, 1)
        if name.startswith("transformer."):
            moved.append((after["model"][now] - weight).abs().max().item())
        else:
            assert torch.equal(after["model"][now], weight), name
    assert 0 < max(moved) < 0.1
    assert len(after["model"]) == len(before["model"])

    assert export.main([str(old), str(tmp_path / "exported")]) == 0
    pipe = DiffusionPipeline.from_pretrained(tmp_path / "exported", local_files_only=True)
    image = pipe("a red square", num_inference_steps=2, height=64, width=64, output_type="pt").images
    assert image.shape == (1, 3, 64, 64) and torch.isfinite(image).all()


def other_releases_name(model):
    """A key of ``model`` as the other transformers release names it: CLIPTextModel's with its text_model level taken
    off where this release has it, put on where it does not."""
    keeps_level = any(k.startswith(LEVEL) for k in model.state_dict())

    def name(key: str) -> str:
        if not key.startswith(BARE):
            return key
        return key.replace(LEVEL, BARE, 1) if keeps_level else key.replace(BARE, LEVEL, 1)

    return name


def test_a_text_encoder_takes_its_weights_under_the_other_releases_names():
    """Both ways: CLIPTextModel's weights named with the text_model level (transformers <= 5.5, the pinned set) or
    without it (5.23, the current set) load strictly into whichever this release builds, and a key that fits neither
    way leaves the whole encoder's keys to the load's missing and unexpected lists."""
    from diffusion.models import build_model
    from diffusion.models.renamed_keys import stored_names

    model = build_model("sd-tiny").model
    renamed = other_releases_name(model)
    other = {renamed(k): torch.randn_like(v) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    assert other.keys() != model.state_dict().keys()
    # a sharded checkpoint is read by name (export, generate): each of the encoder's keys names its stored one
    names = stored_names(model, list(other))
    assert sorted(names) == sorted(k for k in model.state_dict() if k.startswith(BARE)) and set(names.values()) < set(
        other
    )
    model.load_state_dict(other, strict=True)
    assert all(any(torch.equal(v, w) for w in other.values()) for v in model.state_dict().values())

    other["text_encoder.not_a_level.final_layer_norm.bias"] = other.pop(
        next(k for k in other if k.endswith("final_layer_norm.bias"))
    )
    missing, unexpected = model.load_state_dict(other, strict=False)  # all or nothing: every one left as it was
    assert set(missing) == {k for k in model.state_dict() if k.startswith(BARE)}
    assert len(unexpected) == len(missing) and "text_encoder.not_a_level.final_layer_norm.bias" in unexpected


def test_ema_weights_saved_under_the_other_releases_names_load_as_the_models():
    """lora_text_encoder trains CLIP's weights, so the EMA copy holds them by name: saved under the other
    transformers release's names, they load under the model's (a mismatch stopped the run at its first update)."""
    from diffusion.callbacks.ema import EMA
    from diffusion.checkpointing.ema_weights import EMA_STATE
    from diffusion.models import build_model

    model = build_model("sd-tiny").model
    model.text_encoder.requires_grad_(True)
    other = other_releases_name(model)
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    ema = EMA(0.9)
    ema._model = model
    ema.load_state_dict({EMA_STATE: {other(n): p.detach() + 1 for n, p in trained.items()}, "num_updates": 3})
    assert set(ema.ema) == set(trained) and all(torch.equal(ema.ema[n], p.detach() + 1) for n, p in trained.items())
