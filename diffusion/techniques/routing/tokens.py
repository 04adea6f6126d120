"""Token routing (TREAD, Krause et al., ICCV 2025) for transformer denoisers: while training, a random share of each
sample's image tokens skips a span of blocks and rejoins, as it was, in its place after the span, so the blocks in
the span process fewer tokens. Evaluation and sampling (eval mode, or no gradient) send every token through every
block. No extra loss and no new weights: checkpoints, export and sampling are the model's own.

A family opts in by naming its block stacks (``Family.ROUTING``: label -> (the trained part's ModuleList, the config
key of its length); FLUX: double- then single-stream blocks); a span runs from one block to another across the stacks
in that order. The blocks follow diffusers' joint-attention convention (FluxTransformerBlock and
FluxSingleTransformerBlock, SD3's JointTransformerBlock, FLUX.2's Flux2TransformerBlock, Qwen-Image's
QwenImageTransformerBlock; diffusers 0.39 to 0.42): image
tokens come in as ``hidden_states``, the text as ``encoder_hidden_states`` (never routed), and the image tokens go out
last in the returned tuple. A block given no ``encoder_hidden_states`` takes the joined stream, text then image, and
returns it (FLUX.2's Flux2SingleTransformerBlock): its image part is routed, the text's length is the denoiser's
``encoder_hidden_states``'. A block that takes RoPE takes it as ``image_rotary_emb`` over the text then the image
tokens (FLUX, FLUX.2), or as (image, text) complex tables (Qwen-Image): the kept tokens get their own angles, read from
the block's table as its attention processor's per-sample twin declares (``KEPT_ROPE``). SD3's blocks take none
(positions are added once, at the patch embedding), so a kept token carries its place with it. A block argument with
one entry per image token (``PER_TOKEN``: Qwen-Image's ``modulate_index``) is given for the kept tokens only.

Hooks rather than a copy of the model's forward: a pre-hook on the denoiser draws each sample's kept tokens (a fixed
number of them: static shapes under compile), pre-hooks on the span's blocks give them the kept tokens and those
tokens' RoPE angles, and a post-hook on the span's last block scatters its output back among the routed tokens. They
hold under diffusers' gradient checkpointing (blocks called positionally, recomputed in backward), FSDP2's wrapping
of each block and DDP, and leave the parameters' names alone. Diffusers' attention rotates the whole batch by one
RoPE table, so the span's attention modules get the family's twins that also take one table per sample
(``Family.ROUTING_ATTENTION``: its processor -> the twin; models/per_sample_rope.py holds FLUX's, FLUX.2's and
Qwen-Image's).
"""

from __future__ import annotations

import inspect
from functools import partial

import torch

from diffusion.errors import UsageError, spell
from diffusion.models.base import LeadingImage, denoiser_of

BLOCK_ARGS = ("hidden_states", "encoder_hidden_states")  # a routed block's leading parameters
ROPE = "image_rotary_emb"  # a block that takes RoPE takes it by this name (FLUX); one without (SD3) adds positions once
# a block's arguments with one entry per image token (B, S), given to the span's blocks for the kept tokens only:
# Qwen-Image's modulate_index (zero_cond_t: which image tokens take the timestep's modulation, which t = 0's)
PER_TOKEN = ("modulate_index",)


def install_routing(model, share: float, first: str, last: str) -> None:
    """Route ``share`` of the image tokens around ``first`` .. ``last`` in ``model``'s trained part, and in every
    copy of it that FLOP counting traces (``model.denoiser_techniques``)."""
    attach = partial(
        route_tokens, stacks=model.ROUTING, share=share, first=first, last=last, layout=model.ROUTING_LAYOUT,
        attention=model.ROUTING_ATTENTION,
    )  # fmt: skip
    attach(denoiser_of(model))
    model.denoiser_techniques.append(attach)
    model._flops_per_sample.clear()


def route_tokens(
    denoiser: torch.nn.Module,
    *,
    stacks: dict,
    share: float,
    first: str,
    last: str,
    layout: "LeadingImage" = None,
    attention: dict | None = None,
) -> "TokenRouter":
    """Attach a TokenRouter to ``denoiser`` for the span ``first`` .. ``last`` of its ``stacks`` (a
    LeadingImageRouter where the family's blocks take a LeadingImage ``layout``; ``attention``: the family's
    ROUTING_ATTENTION, for blocks that take RoPE)."""  # fmt: skip
    blocks = [(f"{label}.{i}", b) for label, (attr, _) in stacks.items() for i, b in enumerate(getattr(denoiser, attr))]
    names = [name for name, _ in blocks]
    span = [b for _, b in blocks[names.index(first) : names.index(last) + 1]]
    if layout is not None:
        return _route_leading_image(denoiser, span, share, layout)
    router = TokenRouter(share, span)
    denoiser.register_forward_pre_hook(router.draw, with_kwargs=True)
    for block in span:
        block.token_router = (
            router  # REPA on a routed block aligns the kept tokens (diffusion/techniques/repa/alignment.py)
        )
        _check_block(block)
        block.register_forward_pre_hook(router.enter, with_kwargs=True)
        if ROPE in _params(block):
            router.kept_rope = _per_sample_rope(block, attention or {})
    span[-1].register_forward_hook(router.leave, with_kwargs=True)
    return router


def kept_tokens(tokens: int, share: float) -> int:
    """Image tokens a sample keeps in the span: all but round(share x tokens), at least one."""
    return max(1, tokens - round(share * tokens))


class TokenRouter:
    """One forward's routing: ``kept`` (B, K) sorted indices of each sample's image tokens that go through the span
    (None: routing is off for this forward), the image tokens as they entered the span, the kept tokens' RoPE (made
    by ``kept_rope``, the span's attention processors' reading of the family's table) and their PER_TOKEN arguments."""

    def __init__(self, share: float, span: list[torch.nn.Module]):
        self.share, self.first = share, span[0]
        self.params = {block: _params(block) for block in span}  # each block's parameters, in order
        self.kept = self.entered = self.rope = self.text = None
        self.kept_rope, self.per_token = None, {}
        self.active = False

    def draw(self, denoiser, args, kwargs):
        """A new forward of the denoiser: it routes when training with gradients; the kept tokens are drawn where the
        image tokens first enter the span (a denoiser may patchify its input itself: SD3) and kept for this forward,
        so that gradient checkpointing's recompute of the span's blocks sees the same ones. The text's length is
        that of the denoiser's ``encoder_hidden_states`` (where a joined stream's image part starts)."""
        self.kept = self.entered = self.rope = None
        self.per_token = {}
        self.active = denoiser.training and torch.is_grad_enabled()
        params = _params(denoiser)
        at = params.index("encoder_hidden_states") if "encoder_hidden_states" in params else len(args)
        text = args[at] if at < len(args) else kwargs.get("encoder_hidden_states")
        self.text = None if text is None else text.shape[1]
        return None

    def _draw(self, tokens: torch.Tensor) -> None:
        n, s = tokens.shape[:2]
        order = torch.rand(n, s, device=tokens.device).argsort(dim=1)
        self.kept = order[:, : kept_tokens(s, self.share)].sort(dim=1).values

    def enter(self, block, args, kwargs):
        """The kept tokens and their RoPE into a block of the span (called as diffusers calls it: by name, or by
        position under gradient checkpointing; each argument is replaced where it came)."""
        if not self.active:
            return None
        args, params = list(args), self.params[block]

        def given(name):
            i = params.index(name) if name in params else len(args)
            return args[i] if i < len(args) else kwargs.get(name)

        def put(name, value):
            i = params.index(name)
            if i < len(args):
                args[i] = value
            else:
                kwargs[name] = value

        if block is self.first:
            tokens, joined, text = given("hidden_states"), given("encoder_hidden_states") is None, self.text
            if joined:  # text then image in one stream: its image part is routed
                prefix, tokens = tokens[:, :text], tokens[:, text:]
            if self.kept is None:
                self._draw(tokens)
            self.entered = tokens
            kept = tokens.gather(1, self._index(tokens.shape[-1]))
            put("hidden_states", torch.cat([prefix, kept], dim=1) if joined else kept)
            rope = given(ROPE)
            if rope is not None:
                self.rope = self.kept_rope(rope, self.kept, text)
        if self.rope is not None and ROPE in params:
            put(ROPE, self.rope)
        for name in PER_TOKEN:
            value = given(name) if name in params else None
            if value is not None:
                if name not in self.per_token:
                    self.per_token[name] = value.gather(1, self.kept)
                put(name, self.per_token[name])
        return tuple(args), kwargs

    def leave(self, block, args, kwargs, output):
        if not self.active:
            return None
        if isinstance(output, torch.Tensor):  # a joined stream: text, then the kept image tokens
            text, tokens = output[:, : self.text], output[:, self.text :]
            return torch.cat([text, self.entered.scatter(1, self._index(tokens.shape[-1]), tokens)], dim=1)
        *rest, tokens = output
        return (*rest, self.entered.scatter(1, self._index(tokens.shape[-1]), tokens))

    def _index(self, width: int) -> torch.Tensor:
        return self.kept.unsqueeze(-1).expand(-1, -1, width)


def _params(block: torch.nn.Module) -> list[str]:
    return list(inspect.signature(block.forward).parameters)


def _check_block(block: torch.nn.Module) -> None:
    params = _params(block)
    if tuple(params[: len(BLOCK_ARGS)]) != BLOCK_ARGS:
        raise UsageError(
            f"{spell('routing_share')}: {type(block).__name__} takes ({', '.join(params)}), not the joint-attention "
            f"block's ({', '.join(BLOCK_ARGS)}, ...) that routing follows; this diffusers version is not supported"
        )


def _per_sample_rope(block: torch.nn.Module, attention: dict):
    """The block's attention processors swapped for their per-sample-RoPE twins (``attention``: the family's
    ROUTING_ATTENTION); returns how they read the kept tokens' angles from the block's table (the twins' KEPT_ROPE)."""
    kept_rope = None
    twins = tuple(attention.values())
    for module in block.modules():
        processor = getattr(module, "processor", None)
        if isinstance(processor, twins):
            kept_rope = processor.KEPT_ROPE
        if processor is None or isinstance(processor, twins):
            continue
        if type(processor) not in attention:
            raise UsageError(
                f"{spell('routing_share')}: the routed blocks' attention runs {type(processor).__name__}, and the "
                "family offers no twin of it taking one RoPE table per sample (its ROUTING_ATTENTION: "
                f"{', '.join(c.__name__ for c in attention) or 'none'})"
            )
        replacement = attention[type(processor)]()
        replacement._attention_backend = processor._attention_backend
        replacement._parallel_config = getattr(processor, "_parallel_config", None)
        module.set_processor(replacement)
        kept_rope = replacement.KEPT_ROPE
    return kept_rope


class LeadingImageRouter(TokenRouter):
    """TokenRouter for LeadingImage blocks: in the span each sequence is its kept image tokens, then its rest as it
    came; every block of the span gets the per-token inputs cut alike. ``entered`` is the whole sequence as it
    entered the span (a block inside it outputs a shorter one: what REPA's capture compares)."""

    def __init__(self, share: float, span: list[torch.nn.Module], layout: LeadingImage):
        super().__init__(share, span)
        self.layout, self.image, self.cut = layout, None, {}
        self.signatures = {block: inspect.signature(block.forward) for block in span}

    def draw(self, denoiser, args, kwargs):
        self.kept = self.entered = None
        self.cut = {}
        self.active = denoiser.training and torch.is_grad_enabled()
        self.image = self.layout.image_tokens(*args, **kwargs) if self.active else None
        return None

    def enter(self, block, args, kwargs):
        """Called as the denoiser calls the block (positionally, also under gradient checkpointing, or by name)."""
        if not self.active:
            return None
        bound = self.signatures[block].bind(*args, **kwargs)
        given = bound.arguments
        if block is self.first:
            tokens = given[self.layout.tokens]
            if self.kept is None:
                self._draw(tokens[:, : self.image])
            self.entered = tokens
            self.cut = {name: self._cut(given[name]) for name in self.layout.per_token if given.get(name) is not None}
            given[self.layout.tokens] = self._cut(tokens)
        given.update((name, value) for name, value in self.cut.items() if name in given)
        return bound.args, bound.kwargs

    def _cut(self, per_token: torch.Tensor) -> torch.Tensor:
        """The kept image tokens of a (B, S, ...) tensor, then its tokens after the image's."""
        index = self.kept.view(*self.kept.shape, *[1] * (per_token.ndim - 2)).expand(-1, -1, *per_token.shape[2:])
        return torch.cat([per_token[:, : self.image].gather(1, index), per_token[:, self.image :]], dim=1)

    def leave(self, block, args, kwargs, output):
        if not self.active:
            return None
        k = self.kept.shape[1]
        image = self.entered[:, : self.image].scatter(1, self._index(output.shape[-1]), output[:, :k])
        return torch.cat([image, output[:, k:]], dim=1)


def _route_leading_image(denoiser, span: list[torch.nn.Module], share: float, layout: LeadingImage):
    router = LeadingImageRouter(share, span, layout)
    denoiser.register_forward_pre_hook(router.draw, with_kwargs=True)
    for block in span:
        missing = [name for name in (layout.tokens, *layout.per_token) if name not in _params(block)]
        if missing:
            raise UsageError(
                f"{spell('routing_share')}: {type(block).__name__} takes ({', '.join(_params(block))}), not "
                f"{', '.join(missing)}, which routing expects of it; this diffusers version is not supported"
            )
        block.token_router = router
        block.register_forward_pre_hook(router.enter, with_kwargs=True)
    span[-1].register_forward_hook(router.leave, with_kwargs=True)
    return router
