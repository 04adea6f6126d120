"""FP8 training (diffusion/techniques/fp8.py): on every transformer family's tiny preset the conversion swaps for
torchao's Float8Linear exactly the block linears fed tokens whose sides FP8's matmul takes (the layers fed one vector
per sample, as a forward pass shows them, stay), keeps their weights, and follows the recipe asked; and each refusal is one line. A CPU has no
FP8 matmul (torch's _scaled_mm is CUDA's), so the step itself is the GPU's to measure (docs/performance.md)."""

import pytest
import torch
from conftest import synthetic_batch

import benchmark
from diffusion.models import build_model
from diffusion.techniques.fp8 import CONVERTED, Fp8, decisions

# torchao is the fp8 extra's: the pinned set installs it, the current set cannot (PEFT 0.21 refuses torchao < 0.16).
Float8Linear = pytest.importorskip(
    "torchao.float8.float8_linear", reason="torchao (the fp8 extra) is not installed"
).Float8Linear

FAMILIES = (
    "flux-tiny",
    "sd3-tiny",
    "flux2-tiny",
    "qwen-image-tiny",
    "z-image-tiny",
    "krea2-tiny",
    "flux3-tiny",
    "qwen-image-21-tiny",
)


class Run:
    def __init__(self, recipe: str):
        self.fp8 = recipe


def _inputs_per_linear(preset: str, net, part) -> dict[str, int]:
    """Each linear of the trained part -> the number of dimensions of its input in one training forward."""
    seen, hooks = {}, []

    def recorder(name: str):
        def record(module, args, output) -> None:
            seen.setdefault(name, args[0].dim())

        return record

    for name, module in part.named_modules():
        if isinstance(module, torch.nn.Linear):
            hooks.append(module.register_forward_hook(recorder(name)))
    net.train()(synthetic_batch(preset, net, n=2, precomputed=True))
    for hook in hooks:
        hook.remove()
    return seen


@pytest.mark.parametrize("preset", FAMILIES)
def test_the_block_linears_fed_tokens_become_float8_and_nothing_else(preset):
    torch.manual_seed(0)
    net = build_model(preset).model
    part = getattr(net, next(iter(net.PARTS)))
    dims = _inputs_per_linear(preset, net, part)
    stacks = {attribute for attribute, _ in type(net).BLOCKS.values()}
    linears = {n: m for n, m in part.named_modules() if isinstance(m, torch.nn.Linear)}
    sides_fit = {n for n, m in linears.items() if m.in_features % 16 == 0 and m.out_features % 16 == 0}
    fed_tokens = {n for n, d in dims.items() if d == 3 and n.split(".")[0] in stacks} & sides_fit
    before = {n: m.weight.detach().clone() for n, m in linears.items()}
    Fp8.install(Run("tensorwise"), net)
    converted = {n for n, m in part.named_modules() if isinstance(m, Float8Linear)}
    assert converted == fed_tokens and converted, sorted(fed_tokens ^ converted)
    kept = {n for n, d in dims.items() if d == 2} & {n for n, _ in part.named_modules()}
    assert kept.isdisjoint(converted)  # the modulations, inside the blocks or out
    for name, module in part.named_modules():
        if name in before:
            torch.testing.assert_close(module.weight.detach(), before[name], rtol=0, atol=0)
    assert Fp8.results(Run("tensorwise"), net)["layers"] == len(converted)


def test_rowwise_scales_each_row_and_the_reasons_are_given():
    net = build_model("flux-tiny").model
    part = net.transformer
    found = decisions(type(net), part)
    assert found["x_embedder"] == "outside the repeated blocks"
    assert found["transformer_blocks.0.norm1.linear"] == "per-sample modulation"
    assert found["single_transformer_blocks.0.proj_mlp"] == CONVERTED
    Fp8.install(Run("rowwise"), net)
    layer = part.transformer_blocks[0].attn.to_q
    assert isinstance(layer, Float8Linear) and "axs" in repr(layer)  # axiswise scales: one per row


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--model_name", "sd-tiny", "--fp8", "tensorwise"], "--fp8 tensorwise: FP8 converts a transformer's block"),
        (["--model_name", "flux-tiny", "--fp8", "tensorwise"], "needs a GPU with FP8 tensor cores"),
        (["--model_name", "flux-tiny", "--fp8", "tensorwise", "--lora_rank", "4"], "with --lora_rank they are frozen"),
        (["--model_name", "flux-tiny", "--fp8", "e4m3"], "--fp8"),
    ],
)
def test_a_run_fp8_cannot_help_is_one_line(argv, says, capsys):
    assert benchmark.main(["--use_synth_data", "--batch_size", "4", "--num_workers", "0", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
