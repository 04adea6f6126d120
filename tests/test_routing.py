"""diffusion/techniques/routing/tokens.py: token routing (TREAD) on FLUX. A training forward routes each sample's own tokens around the
span and rejoins them in place (checked against an explicit per-sample gather, diffusers' own blocks, scatter);
evaluation and sampling do not route; gradient checkpointing recomputes the same routing; the traced FLOPs count
the span at its kept tokens; runs train, resume bitwise, shard and export with it; bad values are one line."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import FAST, REPO, composer, final_state, read_results
from diffusers.models.transformers.transformer_flux import (
    FluxAttnProcessor,
    FluxSingleTransformerBlock,
    FluxTransformerBlock,
)
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline
from torch.utils.flop_counter import FlopCounterMode

import benchmark
import export
import generate
import train
from diffusion.models import build_model
from diffusion.models.flux import Flux
from diffusion.models.per_sample_rope import PerSampleRope
from diffusion.techniques.routing.tokens import install_routing, route_tokens

BENCH = ["--model_name", "flux-tiny", "--use_synth_data", "--batch_size", "4", "--num_workers", "0"]


def _tiny():
    torch.manual_seed(0)
    return build_model("flux-tiny").model


def _inputs(n=3, side=8):
    g = torch.Generator().manual_seed(1)
    x0, noise = torch.randn(n, 4, side, side, generator=g), torch.randn(n, 4, side, side, generator=g)
    return x0, noise, torch.rand(n, generator=g), torch.randn(n, 32, 32, generator=g), torch.randn(n, 32, generator=g)


def test_training_forward_routes_evaluation_and_sampling_do_not():
    model, inputs = _tiny(), _inputs()
    plain = copy.deepcopy(model)
    install_routing(model, 0.5, "double.0", "single.1")
    model.train(), plain.train()
    assert not torch.equal(model._predict(*inputs)[0], plain._predict(*inputs)[0])
    with torch.no_grad():  # sampling in training mode (the image logger): every token, every block
        assert torch.equal(model._predict(*inputs)[0], plain._predict(*inputs)[0])
    model.eval(), plain.eval()
    assert torch.equal(model._predict(*inputs)[0], plain._predict(*inputs)[0])


def test_each_sample_routes_its_own_tokens_which_rejoin_in_place():
    """The span's output equals, per sample, diffusers' own blocks (its own attention processor, one RoPE table)
    run on that sample's kept tokens, scattered back among the routed tokens, which leave the span as they came."""
    t = _tiny().transformer
    plain = copy.deepcopy(t)
    router = route_tokens(
        t, stacks=Flux.ROUTING, share=0.5, first="double.0", last="single.1", attention=Flux.ROUTING_ATTENTION
    )
    seen = {}
    t.transformer_blocks[0].register_forward_pre_hook(lambda m, a, kw: seen.update(kw), prepend=True, with_kwargs=True)
    t.single_transformer_blocks[1].register_forward_hook(lambda m, a, out: seen.update(out=out[1]))
    g = torch.Generator().manual_seed(2)
    t.train()(
        hidden_states=torch.randn(3, 16, 16, generator=g),  # 8 x 8 latents of 4 channels: 16 tokens of 2 x 2 patches
        encoder_hidden_states=torch.randn(3, 32, 32, generator=g),
        pooled_projections=torch.randn(3, 32, generator=g),
        timestep=torch.rand(3, generator=g),
        img_ids=FluxPipeline._prepare_latent_image_ids(3, 4, 4, "cpu", torch.float32),
        txt_ids=torch.zeros(32, 3),
    )
    kept, entered, out = router.kept, seen["hidden_states"], seen["out"]
    n, tokens = entered.shape[:2]
    assert kept.shape == (n, tokens // 2) and len({tuple(k.tolist()) for k in kept}) == n  # each sample its own
    routed = torch.ones(n, tokens, dtype=torch.bool).scatter(1, kept, False)
    assert torch.equal(out[routed], entered[routed])
    text = seen["encoder_hidden_states"].shape[1]
    for i in range(n):
        h, e, temb = entered[i : i + 1, kept[i]], seen["encoder_hidden_states"][i : i + 1], seen["temb"][i : i + 1]
        rope = tuple(torch.cat([c[:text], c[text:][kept[i]]]) for c in seen["image_rotary_emb"])
        for block in [*plain.transformer_blocks, *plain.single_transformer_blocks]:
            e, h = block(hidden_states=h, encoder_hidden_states=e, temb=temb, image_rotary_emb=rope)
        torch.testing.assert_close(out[i, kept[i]], h[0], rtol=1e-5, atol=1e-5)
    assert all(isinstance(b.attn.processor, PerSampleRope) for b in t.single_transformer_blocks)
    assert type(plain.single_transformer_blocks[0].attn.processor) is FluxAttnProcessor


def test_gradient_checkpointing_recomputes_the_same_routing():
    grads = []
    for checkpointing in (False, True):
        model = _tiny()
        install_routing(model, 0.5, "double.0", "single.0")
        if checkpointing:
            model.transformer.enable_gradient_checkpointing()
        model.train()
        torch.manual_seed(3)
        F.mse_loss(*model._predict(*_inputs())).backward()
        grads.append({n: p.grad for n, p in model.transformer.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def _block_flops(block_cls, image_tokens: int, model) -> float:
    """A fresh block's forward + backward FLOPs at ``image_tokens`` beside the text, traced as count_flops traces
    (on the meta device, where attention is counted too)."""
    cfg, text = model.transformer.config, model.text_length
    heads, width = cfg.num_attention_heads, cfg.num_attention_heads * cfg.attention_head_dim
    with torch.device("meta"):
        block = block_cls(width, heads, cfg.attention_head_dim)
        h, e, temb = (
            torch.randn(*s, requires_grad=True) for s in ((1, image_tokens, width), (1, text, width), (1, width))
        )
        rope = (torch.randn(text + image_tokens, cfg.attention_head_dim),) * 2
        with FlopCounterMode(display=False) as counter:
            out = block(hidden_states=h, encoder_hidden_states=e, temb=temb, image_rotary_emb=rope)
            (out[0].sum() + out[1].sum()).backward()
    return float(counter.get_total_flops())


def test_traced_flops_count_the_span_at_its_kept_tokens():
    model = _tiny()
    full = model.flops_per_sample(128, online=False)["denoiser"]  # 128 px: 8 x 8 = 64 image tokens, 32 text
    install_routing(model, 0.5, "double.0", "single.0")
    routed = model.flops_per_sample(128, online=False)["denoiser"]
    span = (FluxTransformerBlock, FluxSingleTransformerBlock)
    saved = sum(_block_flops(b, 64, model) - _block_flops(b, 32, model) for b in span)
    assert routed == pytest.approx(full - saved, rel=1e-9)
    assert 0.25 < saved / full < 0.3  # two of three blocks at 32 of their 64 image tokens (beside 32 text tokens)


def test_default_span_is_the_second_block_to_the_second_to_last():
    from diffusion.config import TrainConfig
    from diffusion.models.build import FAMILIES
    from diffusion.techniques.routing import stack_lengths
    from diffusion.trainer import check_before_build

    cfg = TrainConfig(model_name="flux-small", use_synth_data=True, batch_size=2, routing_share=0.5)
    geometry = check_before_build(cfg, world_size=1, on_gpu=False)
    assert stack_lengths(FAMILIES[geometry.family], geometry.denoiser_config) == {"double": 2, "single": 6}
    assert (cfg.routing_first, cfg.routing_last) == ("double.1", "single.4")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--routing_share", "1"], "--routing_share 1.0 must be in (0, 1)"),
        (["--routing_share", "0"], "--routing_share 0.0 must be in (0, 1)"),
        (["--routing_share", "0.5", "--routing_first", "single.2"], "--routing_first single.2: flux-tiny has no such"),
        (["--routing_share", "0.5", "--routing_last", "double.3"], "its blocks: double.0, single.0 to single.1"),
        (["--routing_share", "0.5", "--routing_last", "triple.0"], "--routing_last triple.0: flux-tiny has no such"),
        (["--routing_share", "0.5", "--routing_first", "single.1", "--routing_last", "single.0"], "comes after"),
        (["--routing_last", "single.0"], "--routing_last is set but --routing_share is not"),
        (["--routing_share", "0.5", "--model_name", "sd-tiny"], "sd-tiny is an SD model, which has none to route"),
        (["--routing_share", "0.5", "--model_name", "sdxl-tiny"], "sdxl-tiny is an SDXL model, which has none"),
    ],
)
def test_bad_values_are_one_line(argv, message, capsys):
    assert benchmark.main([*BENCH, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("benchmark.py: error: ") and message in err[0], err


def test_benchmark_records_routing_and_counts_its_flops_over_buckets(tmp_path):
    out = tmp_path / "r.jsonl"
    args = ["--routing_share", "0.5", "--synthetic_buckets", "1x1,1x2", "--max_duration", "4ba"]
    assert benchmark.main([*BENCH, *args, "--results", str(out)]) == 0
    (rec,) = read_results(out)
    assert rec["routing"] == {"share": 0.5, "first": "single.0", "last": "single.0"}  # the default span
    model = _tiny()
    plain = model.flops_per_sample(64)["total"] / 1e12
    install_routing(model, 0.5, "single.0", "single.0")
    routed = model.flops_per_sample(64)["total"] / 1e12
    assert rec["tflop_per_image"] == pytest.approx(routed) and routed < plain


def test_resumes_bitwise_and_trains_other_weights_than_without_routing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = [str(REPO / "yamls/flux-tiny-cpu.yaml"), *FAST, "batch_size=4", "save_interval=2ba", "use_ema=false"]
    routed = [*args, "routing_share=0.5", "routing_first=double.0"]
    assert train.main([*routed, f"save_folder={tmp_path / 'a'}", "max_duration=4ba"]) == 0
    assert train.main([*routed, f"save_folder={tmp_path / 'b'}", "max_duration=2ba"]) == 0
    assert train.main([*routed, f"save_folder={tmp_path / 'b'}", "max_duration=4ba", "autoresume=true"]) == 0
    assert train.main([*args, f"save_folder={tmp_path / 'c'}", "max_duration=4ba"]) == 0
    a, b, c = (final_state(tmp_path / x)["model"] for x in "abc")
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not all(torch.equal(a[n], c[n]) for n in a)


def test_export_and_generate_from_a_routing_checkpoint_use_every_token(tmp_path, monkeypatch):
    from diffusion.eval.trained_model import load_trained

    monkeypatch.chdir(tmp_path)
    run = [str(REPO / "yamls/flux-tiny-cpu.yaml"), *FAST, "batch_size=4", "max_duration=2ba", "save_interval=2ba"]
    assert train.main([*run, "routing_share=0.5", f"save_folder={tmp_path / 'ck'}"]) == 0
    ckpt = str(tmp_path / "ck" / "latest-rank0.pt")
    built, config, _ = load_trained(ckpt)
    t = built.model.transformer
    assert config["routing_share"] == 0.5 and not t._forward_pre_hooks and not built.model.denoiser_techniques
    assert all(type(b.attn.processor) is FluxAttnProcessor for b in t.single_transformer_blocks)
    assert export.main([ckpt, str(tmp_path / "exported")]) == 0
    assert generate.main([ckpt, "--prompt", "a cube", "--steps", "2", "--out", str(tmp_path / "s")]) == 0
    assert (tmp_path / "s" / "00000-a-cube.png").exists()


@pytest.mark.slow
def test_ddp_two_ranks_train_with_routing(tmp_path):
    args = [*BENCH, "--routing_share", "0.5", "--routing_first", "double.0", "--max_duration", "3ba"]
    proc = composer(2, "benchmark.py", *args, "--results", "r.jsonl", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rec,) = read_results(tmp_path / "r.jsonl")
    assert rec["world_size"] == 2 and not rec["fsdp"] and rec["routing"]["first"] == "double.0"


@pytest.mark.slow
def test_fsdp2_routes_inside_the_sharded_blocks_and_resumes_bitwise(tmp_path):
    proc = composer(2, "tests/routing_fsdp_worker.py", str(tmp_path / "ck"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ROUTING-FSDP-OK" in proc.stdout + proc.stderr
