"""FLUX.2 [dev] (diffusion/models/flux2_dev.py): its captions and text states are Flux2Pipeline's (the system message
through the processor's chat template, Mistral layers 10/20/30), the guidance embedding gets the script's 3.5, the
tiny preset through benchmark.py (FLOPs in the results line), export as a Flux2Pipeline folder that samples and builds again, and LoRA
adapters that the pipeline's load_lora_weights loads. klein's shared step (latents, ids, routing) and the full-size
presets' sizes and FLOPs are test_flux2.py's."""

import pytest
import torch
from conftest import read_results, synthetic_benchmark

import benchmark
import export
import generate
from diffusion.errors import UsageError
from diffusion.models import build_model
from diffusion.models.flux2_dev import DEV_TEXT_LAYERS, Flux2Dev, SystemCaptions


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return build_model("flux2-dev-tiny")


def _ids(tiny, captions):
    return tiny.tokenizers["input_ids"](
        list(captions), padding="max_length", truncation=True, max_length=tiny.model.text_length, return_tensors="pt"
    ).input_ids


def test_text_states_are_the_pipelines_and_the_guidance_the_scripts(tiny):
    """Captions written as Flux2Pipeline writes them (its system message, the processor's chat template, one <s>),
    and the stacked Mistral layers 10/20/30 with the padding masked equal _get_mistral_3_small_prompt_embeds; the
    transformer gets guidance 3.5 (train_dreambooth_lora_flux2.py's --guidance_scale)."""
    from diffusers import Flux2Pipeline

    model, captions = tiny.model, ["a red 3", "two [IMG]cats"]
    pipe = model.pipeline(tiny.tokenizers)
    assert type(pipe) is Flux2Pipeline and isinstance(tiny.tokenizers["input_ids"], SystemCaptions)
    ids = _ids(tiny, captions)
    text = pipe.tokenizer.tokenizer.decode(ids[0])
    assert text.startswith("<s>[SYSTEM_PROMPT]You are an AI") and "[/SYSTEM_PROMPT][INST]a red 3[/INST]<pad>" in text
    assert (ids[:, :2] == 257).sum() == 2  # one <s> each: the template's
    theirs = Flux2Pipeline._get_mistral_3_small_prompt_embeds(
        model.text_encoder, pipe.tokenizer, captions, max_sequence_length=model.text_length
    )
    ours, pooled = model.encode_text({"input_ids": ids})
    assert pooled is None and ours.shape == (2, 96, len(DEV_TEXT_LAYERS) * 32)
    torch.testing.assert_close(ours, theirs)
    seen = {}
    hook = model.transformer.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    try:
        model._predict(torch.randn(2, 16, 4, 4), torch.randn(2, 16, 4, 4), torch.rand(2), ours)
    finally:
        hook.remove()
    assert seen["guidance"].tolist() == [3.5, 3.5]


def test_dev_preset_has_the_guidance_embedding_and_mistrals_language_model():
    """The full-size preset (its sizes and FLOPs: test_flux2.py's hand count) takes the guidance input at 3.5; its text
    states come from Mistral Small 3.1's language model (22.9B of the encoder's 24.0B: no LM head, no vision tower)."""
    with torch.device("meta"):
        model = build_model("flux2-dev").model
    assert model.transformer.config.guidance_embeds and model.objective["guidance"] == 3.5
    assert model.transformer.config.joint_attention_dim == len(DEV_TEXT_LAYERS) * model.text_body.config.hidden_size
    assert sum(p.numel() for p in model.text_body.parameters()) == pytest.approx(22.90e9, rel=0.005)


def test_benchmark_results_line_has_traced_flops(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (rec,) = synthetic_benchmark("flux2-dev-tiny")
    assert rec["family"] == "flux2-dev" and rec["prediction_type"] == "flow"
    assert rec["tflop_per_image"] > rec["tflop_per_image_denoiser"] > 0


def test_export_loads_as_flux2_pipeline_samples_and_builds_again(tiny, tmp_path):
    """The folder is a Flux2Pipeline with a PixtralProcessor as its tokenizer; a run from it reads the processor, its
    caption length and padding id, and tokenizes as the preset did; generate.py samples from it."""
    from diffusers import DiffusionPipeline

    out = tmp_path / "dev"
    assert export.main(["flux2-dev-tiny", str(out)]) == 0
    pipe = DiffusionPipeline.from_pretrained(out, local_files_only=True)
    assert type(pipe).__name__ == "Flux2Pipeline" and type(pipe.tokenizer).__name__ == "PixtralProcessor"
    again = build_model(str(out))
    assert type(again.model).__name__ == "Flux2Dev"
    assert (again.model.objective["max_sequence_length"], again.model.objective["pad_token_id"]) == (96, 266)
    assert torch.equal(_ids(again, ["a red 3"]), _ids(tiny, ["a red 3"]))
    assert generate.main([str(out), "--prompt", "a red 3", "--steps", "2", "--out", str(tmp_path / "gen")]) == 0
    assert (tmp_path / "gen" / "00000-a-red-3.png").exists()


def test_lora_adapters_load_with_the_pipelines_load_lora_weights(tmp_path, monkeypatch, capsys):
    """A LoRA run from a Flux2Pipeline folder, its adapters exported: Flux2Pipeline.load_lora_weights loads every one
    of them (transformer keys only: the pipeline reads no text encoder adapters), and generate.py samples with them;
    adapters of other widths are one line."""
    from diffusers import DiffusionPipeline
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from diffusion.techniques.lora.adapters import WEIGHTS

    monkeypatch.chdir(tmp_path)
    assert export.main(["flux2-dev-tiny", "dev"]) == 0
    args = ["--use_synth_data", "--model_name", "dev", "--lora_rank", "4", "--batch_size", "4", "--num_workers", "0"]
    assert benchmark.main([*args, "--max_duration", "1ba", "--save_folder", "L", "--save_interval", "1ba"]) == 0
    assert export.main(["L/latest-rank0.pt", "lora"]) == 0
    file = tmp_path / "lora" / WEIGHTS
    with safe_open(file, "pt") as f:
        keys = list(f.keys())
    assert {k.split(".", 1)[0] for k in keys} == {"transformer"}
    assert any("single_transformer_blocks.1.attn.to_out" in k for k in keys)
    pipe = DiffusionPipeline.from_pretrained("dev", local_files_only=True)
    pipe.load_lora_weights("lora", weight_name=WEIGHTS, adapter_name="lora")
    loaded = [n for n, _ in pipe.transformer.named_parameters() if "lora_A.lora" in n]
    assert len(loaded) == sum(".lora_A." in k for k in keys) > 0
    assert generate.main(["dev", "--lora", "lora", "--prompt", "a", "--steps", "1", "--out", "gen"]) == 0

    # the same layers at other widths (a klein adapter on a dev base: 3072 against 6144) are one line naming the layer,
    # where diffusers would stop on a size mismatch
    wider = {k: torch.zeros(v.shape[0], 2 * v.shape[1]) if ".lora_A." in k else v for k, v in load_file(file).items()}
    save_file(wider, file)
    capsys.readouterr()
    assert generate.main(["dev", "--lora", "lora", "--prompt", "a", "--steps", "1", "--out", "gen"]) == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("generate.py: error:")]
    assert "of other widths" in line and "in_features" in line and "Traceback" not in err, err


def test_precompute_then_train_on_the_stored_text_states(mds_images, tmp_path):
    """flux2-dev-finetune.yaml's path: data.py precompute stores the stacked Mistral states (captions written with the
    system message) and the VAE moments; a run on them counts no encoder FLOPs."""
    from conftest import read_mds

    from diffusion.precompute import precompute

    out = tmp_path / "latents"
    report = precompute(
        str(mds_images), str(out), model_name="flux2-dev-tiny", image_size=64, batch_size=8, num_workers=0,
        progress=False,
    )  # fmt: skip
    assert report["written"] == 32 and report["columns"]["text_embeds"].endswith(":96,96")
    assert "pooled_text_embeds" not in read_mds(out)[0]
    results = tmp_path / "r.jsonl"
    args = ["--model_name", "flux2-dev-tiny", "--local", str(out), "--precomputed_latents", "--text_encoders_on_cpu"]
    args += ["--batch_size", "4"]
    assert benchmark.main([*args, "--num_workers", "0", "--max_duration", "2ba", "--results", str(results)]) == 0
    (rec,) = read_results(results)
    assert rec["precomputed_latents"] and rec["tflop_per_image"] == rec["tflop_per_image_denoiser"] > 0


def test_another_familys_objective_key_is_one_line(capsys):
    args = ["--use_synth_data", "--batch_size", "4", "--model_name", "flux2-dev-tiny", "--objective", "t5_length=3"]
    assert benchmark.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown FLUX.2 [dev] objective key(s) ['t5_length']" in err and len(err.splitlines()) == 1, err


def test_the_objective_keys_dev_shares_with_klein_are_read():
    """[dev]'s objective section is klein's with three keys declared again: klein's others (the timestep draw and
    its shift) are dev's keys too, each typed and checked as klein declares it."""
    given = {"shift": 3.0, "timesteps": "logit_normal", "guidance": 4.0}
    options = Flux2Dev.objective_options(given)
    assert {k: options[k] for k in given} == given and options["pad_token_id"] == 11
    with pytest.raises(UsageError, match="objective.shift"):
        Flux2Dev.objective_options({"shift": -1})


def test_a_dev_folder_without_its_parts_is_one_line(tmp_path, capsys):
    """A Flux2Pipeline folder is this family's: one that lacks a part is refused in one line naming it."""
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "model_index.json").write_text('{"_class_name": "Flux2Pipeline"}')
    assert benchmark.main(["--use_synth_data", "--model_name", str(tmp_path / "dev"), "--batch_size", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "lacks the 'transformer' folder a Flux2Pipeline needs" in err and len(err.splitlines()) == 1, err
