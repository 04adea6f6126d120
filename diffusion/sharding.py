"""FSDP wrapping rules that hold for any model family.

Composer's FSDP2 path wraps each direct child of the ComposerModel and, inside it, every module its
``fsdp_wrap_fn`` accepts. The rule here reads only the module tree, never attribute names:
- a child with trainable parameters is sharded, with one FSDP unit per *outermost repeated block*:
  a module held in an ``nn.ModuleList`` that is not itself inside such a block (UNet down/up blocks,
  transformer blocks of FLUX or CLIP);
- a child with no trainable parameters (a frozen VAE or text encoder) is not sharded: it is replicated,
  runs outside the FSDP hooks (e.g. ``vae.encode``), and needs no gradient communication.
"""

from __future__ import annotations

import warnings

import torch


def outermost_blocks(root: torch.nn.Module) -> set[torch.nn.Module]:
    blocks: set[torch.nn.Module] = set()

    def visit(module: torch.nn.Module) -> None:
        for child in module.children():
            if isinstance(module, torch.nn.ModuleList) and not isinstance(child, torch.nn.ModuleList):
                blocks.add(child)  # a block: do not descend, inner lists belong to it
            else:
                visit(child)

    visit(root)
    return blocks


def mark_fsdp_units(model: torch.nn.Module) -> list[str]:
    """Set Composer's FSDP hints on ``model``'s children; returns the names of the sharded children."""
    warnings.filterwarnings("ignore", message="The _fsdp_wrap attribute will be removed", category=DeprecationWarning)
    sharded = []
    for name, child in model.named_children():
        if any(p.requires_grad for p in child.parameters()):
            blocks = outermost_blocks(child)
            child.fsdp_wrap_fn = lambda m, blocks=blocks: m in blocks
            sharded.append(name)
        else:
            child._fsdp_wrap = False
    return sharded
