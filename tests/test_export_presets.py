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
    "flux2-dev-tiny": "Flux2Pipeline",
    "krea2-tiny": "Krea2Pipeline",
    "flux3-tiny": "Flux3ModularPipeline",  # a modular pipeline's folder, read by its own loader (open_pipeline)
    "flux3-distilled-tiny": "Flux3DistilledModularPipeline",
    "qwen-image-21-tiny": "QwenImage21Pipeline",
}


@pytest.mark.parametrize("preset", list(PIPELINES))
def test_a_preset_is_written_as_a_pipeline_that_diffusers_and_its_scripts_load(preset, tmp_path, capsys):
    from diffusion.models import build_model
    from diffusion.models.build import family_of_dir

    out = tmp_path / preset
    assert export.main([preset, str(out), "--seed", "3"]) == 0
    assert f"exported the preset {preset} (random weights, seed 3)" in capsys.readouterr().out
    pipe = family_of_dir(str(out)).open_pipeline(str(out))  # DiffusionPipeline's loader, or a modular pipeline's
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


# Captions slow and fast CLIP forms must cut alike: cases, punctuation, digits, CLIP's contractions, whitespace, accents
# (composed and not), other scripts, emoji, a special token's text, and ones past max_length (truncated) or empty
CAPTIONS = [
    "A photo of a CAT", "héllo WORLD, it's 3:45 p.m.!", "don't stop -- 1234567890", "Ünïcödé naïve café résumé",
    "e\u0301 decomposed", "emoji 🐱🚀 ok", "tabs\tand\nnewlines  many   spaces", "Привет мир Ωμέγα ₀² ½ Ⅳ",
    "a.b,c;d:e?f!g'h\"i(j)k[l]{m}", "it's they're we've I'm you'll he'd", "<|endoftext|> inside", "x" * 300,
    "word " * 100, "",
]  # fmt: skip
# Each family's tokenizer classes, by folder: the pipeline's (model_index.json names them) and diffusers' scripts'
# (train_text_to_image*.py, train_dreambooth_lora_{sdxl,flux,sd3,flux2,qwen_image}.py): CLIPTokenizer slow, T5's and
# FLUX.2's fast, Qwen-Image's slow; each also by its other form and AutoTokenizer (what train.py reads a folder with)
CLASSES = {
    "sd-tiny": {"tokenizer": ("CLIPTokenizer", "CLIPTokenizerFast")},
    "sdxl-tiny": {folder: ("CLIPTokenizer", "CLIPTokenizerFast") for folder in ("tokenizer", "tokenizer_2")},
    "flux-tiny": {"tokenizer": ("CLIPTokenizer", "CLIPTokenizerFast"), "tokenizer_2": ("T5TokenizerFast",)},
    "sd3-tiny": {
        **{folder: ("CLIPTokenizer", "CLIPTokenizerFast") for folder in ("tokenizer", "tokenizer_2")},
        "tokenizer_3": ("T5TokenizerFast",),
    },
    "flux2-tiny": {"tokenizer": ("Qwen2TokenizerFast", "Qwen2Tokenizer")},
    "z-image-tiny": {"tokenizer": ("Qwen2TokenizerFast", "Qwen2Tokenizer")},
    "qwen-image-tiny": {"tokenizer": ("Qwen2Tokenizer", "Qwen2TokenizerFast")},
    "krea2-tiny": {"tokenizer": ("Qwen2Tokenizer", "Qwen2TokenizerFast")},
}


@pytest.mark.parametrize("preset", list(CLASSES))
def test_each_tokenizer_folder_is_read_by_the_familys_own_classes_to_the_ids_train_py_trains_on(preset, tmp_path):
    """Issue 55 item 3: each exported tokenizer folder loads with its family's classes, slow and fast, and every one
    gives the training tokenizer's ids, padded and truncated to max_length; the chat kinds also format a caption
    with the same chat template; model_index.json names the pipeline's own class (CLIPTokenizer, Qwen2Tokenizer)."""
    import json

    import transformers

    from diffusion.models import build_model

    assert export.main([preset, str(tmp_path)]) == 0
    built, index = build_model(preset), json.loads((tmp_path / "model_index.json").read_text())
    family, pipeline = type(built.model), built.model.pipeline(built.tokenizers)
    for folder, names in CLASSES[preset].items():
        ours = pipeline.components[folder]
        # a T5 slot's folder is named by its saved class: transformers 5's T5TokenizerFast reads Unigram models only
        named = type(ours) if "T5" in names[0] else getattr(transformers, names[0])  # 5: the Fast names are aliases
        assert index[folder] == ["transformers", named.__name__], folder
        n = ours.model_max_length
        captions = CAPTIONS if "CLIP" in names[0] else [*CAPTIONS[:-1], ours.apply_chat_template(
            [{"role": "user", "content": "a cat"}], tokenize=False, add_generation_prompt=True, enable_thinking=False
        )] if ours.chat_template else CAPTIONS  # fmt: skip
        want = ours(captions, padding="max_length", max_length=n, truncation=True).input_ids
        for name in (*names, "AutoTokenizer"):
            theirs = getattr(transformers, name).from_pretrained(tmp_path / folder, local_files_only=True)
            assert theirs(captions, padding="max_length", max_length=n, truncation=True).input_ids == want, name
            assert (theirs.pad_token_id, theirs.eos_token_id, len(theirs)) == (
                ours.pad_token_id, ours.eos_token_id, len(ours)
            ), name  # fmt: skip
            assert theirs.chat_template == ours.chat_template, name
    assert set(CLASSES[preset]) == set(family.TOKENIZERS)


def test_the_ids_fit_every_presets_text_encoders():
    """Every preset's tokenizers give ids its text encoders have embeddings for (the CLIP slots: 488 ids), and the
    text configs name the tokenizer's eos, bos and pad (CLIPTextModel pools at eos_token_id)."""
    from diffusion.models.presets import PRESETS
    from diffusion.models.tokenizer import build_tokenizer

    for name, spec in PRESETS.items():
        for folder, encoder in (
            ("tokenizer", "text_encoder"),
            ("tokenizer_2", "text_encoder_2"),
            ("tokenizer_3", "text_encoder_3"),
            ("processor", "text_encoder"),  # Qwen-Image 2.1's Qwen3VLProcessor
        ):
            if folder in spec:
                tokenizer = build_tokenizer(spec[folder])
                # a processor's tokenizer (FLUX.2 [dev]'s PixtralProcessor, Qwen-Image 2.1's Qwen3VLProcessor)
                tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
                config = spec[encoder].get("text_config", spec[encoder])  # Qwen2.5-VL's language model's, nested
                assert len(tokenizer) <= config["vocab_size"], (name, folder)
                for token in ("eos", "bos", "pad"):
                    got = getattr(tokenizer, f"{token}_token_id")
                    assert config.get(f"{token}_token_id", got) in (got, None), (name, folder, token)


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
