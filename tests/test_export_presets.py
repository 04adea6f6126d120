"""export.py PRESET OUT: a preset written as the diffusers folder its family's pipeline loads (random weights from
--seed), with tokenizers that diffusers' own training scripts load by their own classes and that give the ids
train.py trains on (issue 55: the tokenizer was tokenizer.json only, so CLIPTokenizer.from_pretrained failed,
and a preset took a Python one-liner to write)."""

import pytest
import torch
from conftest import REPO, read_results

import export
import train

PIPELINES = {
    "sd-tiny": "StableDiffusionPipeline",
    "sdxl-tiny": "StableDiffusionXLPipeline",
    "flux-tiny": "FluxPipeline",
    "flux2-tiny": "Flux2KleinPipeline",
    "sd3-tiny": "StableDiffusion3Pipeline",
    "z-image-tiny": "ZImagePipeline",
    "qwen-image-tiny": "QwenImagePipeline",
}


@pytest.mark.parametrize("preset", list(PIPELINES))
def test_a_preset_is_written_as_a_pipeline_that_diffusers_and_its_scripts_load(preset, tmp_path, capsys):
    from diffusers import DiffusionPipeline

    from diffusion.models import build_model

    out = tmp_path / preset
    assert export.main([preset, str(out), "--seed", "3"]) == 0
    assert f"exported the preset {preset} (random weights, seed 3)" in capsys.readouterr().out
    pipe = DiffusionPipeline.from_pretrained(out, local_files_only=True)
    assert type(pipe).__name__ == PIPELINES[preset]
    torch.manual_seed(3)
    built = build_model(preset)  # the weights are the preset's, drawn from the seed
    denoiser = "unet" if preset.startswith("sd-") or preset.startswith("sdxl-") else "transformer"
    for (name, ours), (_, theirs) in zip(
        getattr(built.model, denoiser).state_dict().items(), getattr(pipe, denoiser).state_dict().items()
    ):
        torch.testing.assert_close(ours, theirs, msg=name)


def test_the_moving_over_flow_trains_from_the_written_preset_on_the_data_beside_the_recipe(mds_images, tmp_path):
    """Issue 55's path end to end: a preset written as a folder, then the tiny recipe from that folder with an MDS
    dataset on the command line (no use_synth_data=false): the run reads the folder's tokenizer and the dataset."""
    assert export.main(["sd-tiny", str(tmp_path / "init")]) == 0
    args = [str(REPO / "yamls/sd-tiny-cpu.yaml"), f"model_name={tmp_path / 'init'}", f"local={mds_images}"]
    short = ["max_duration=2ba", "batch_size=4", "eval_interval=never", "autoresume=false", "save_folder=null"]
    assert train.main([*args, *short, f"results={tmp_path / 'r.jsonl'}"]) == 0
    (line,) = read_results(tmp_path / "r.jsonl")
    assert line["synthetic"] is False and line["model"] == str(tmp_path / "init"), line


def test_the_ids_fit_every_presets_text_encoders():
    """Every preset's tokenizers give ids its text encoders have embeddings for (the CLIP slots: 482 ids)."""
    from diffusion.models.presets import PRESETS
    from diffusion.models.tokenizer import build_tokenizer

    for name, spec in PRESETS.items():
        for folder, encoder in (
            ("tokenizer", "text_encoder"),
            ("tokenizer_2", "text_encoder_2"),
            ("tokenizer_3", "text_encoder_3"),
        ):
            if folder in spec:
                tokenizer = build_tokenizer(spec[folder])
                config = spec[encoder].get("text_config", spec[encoder])  # Qwen2.5-VL's language model's, nested
                assert len(tokenizer) <= config["vocab_size"], (name, folder)
                assert tokenizer.eos_token_id == config.get("eos_token_id", tokenizer.eos_token_id)


def test_an_autoencoder_preset_is_written_as_an_autoencoder_folder(tmp_path):
    from diffusers import AutoencoderKL

    assert export.main(["vae-tiny", str(tmp_path / "vae")]) == 0
    vae = AutoencoderKL.from_pretrained(tmp_path / "vae", local_files_only=True)
    assert vae.config.latent_channels == 4 and vae.config.scaling_factor == 1.0


@pytest.mark.parametrize(
    "args,says",
    [
        (["sd-tinny", "OUT"], "CHECKPOINT|PRESET 'sd-tinny' is no checkpoint (no such file or folder) and no preset"),
        (["sd-tiny", "OUT", "--merge"], "--merge: sd-tiny is a preset, not a LoRA run"),
    ],
)
def test_neither_a_checkpoint_nor_a_preset_is_one_line(args, says, tmp_path, capsys):
    assert export.main([a.replace("OUT", str(tmp_path / "out")) for a in args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("export.py: error: ") and says in err[0], err
    assert not (tmp_path / "out").exists()
