"""Attention that takes one RoPE table per sample: twins of diffusers' attention processors (FLUX.1's, FLUX.2's
double- and single-stream, Qwen-Image's) which, given a table per sample ((B, S, D) cos and sin), rotate each
sample's tokens by its own angles, and with one table for the batch are diffusers' own. Token routing needs them
(techniques/routing/): the tokens a sample keeps in a routed span sit at other places than another sample's. A family
offers them to routing in ``ROUTING_ATTENTION`` (its processor -> the twin); each twin's ``KEPT_ROPE`` says how the
kept tokens' angles come from the block's table.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor
from diffusers.models.transformers.transformer_flux2 import Flux2AttnProcessor, Flux2ParallelSelfAttnProcessor
from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0


def _joint_attention(processor, attn, hidden_states, encoder_hidden_states, attention_mask, rope):
    """FluxAttnProcessor's, Flux2AttnProcessor's and QwenDoubleStreamAttnProcessor2_0's maths (their projections
    unfused) with one RoPE table per sample:
    q, k, v (per head, q and k normalised), text before image, rotation of interleaved pairs, attention through
    diffusers' dispatcher; the image's output projected, then the text's."""

    def heads(x):
        return x.unflatten(-1, (attn.heads, -1))

    q, k, v = heads(attn.to_q(hidden_states)), heads(attn.to_k(hidden_states)), heads(attn.to_v(hidden_states))
    q, k = attn.norm_q(q), attn.norm_k(k)
    joint = encoder_hidden_states is not None and attn.added_kv_proj_dim is not None
    if joint:
        e = encoder_hidden_states
        q = torch.cat([attn.norm_added_q(heads(attn.add_q_proj(e))), q], dim=1)
        k = torch.cat([attn.norm_added_k(heads(attn.add_k_proj(e))), k], dim=1)
        v = torch.cat([heads(attn.add_v_proj(e)), v], dim=1)
    q, k = _rotate(q, rope), _rotate(k, rope)
    out = dispatch_attention_fn(
        q, k, v, attn_mask=attention_mask, backend=processor._attention_backend,
        parallel_config=processor._parallel_config,
    )  # fmt: skip
    out = out.flatten(2, 3).to(q.dtype)
    if not joint:
        return out
    text, image = out.split_with_sizes(
        [encoder_hidden_states.shape[1], out.shape[1] - encoder_hidden_states.shape[1]], 1
    )
    return attn.to_out[1](attn.to_out[0](image.contiguous())), attn.to_add_out(text.contiguous())


def _one_table(rope) -> bool:
    return rope is None or rope[0].ndim == 2


def joined_rope(rope, kept: torch.Tensor, text: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FLUX's and FLUX.2's table: (cos, sin), each (S, D) over the text then the image tokens -> each (B, S', D), the
    text's rows, then the kept image tokens' (``kept`` (B, K) indices among the image tokens)."""
    n = kept.shape[0]
    return tuple(torch.cat([t[:text].expand(n, -1, -1), t[text:][kept]], dim=1) for t in rope)


def image_text_rope(rope, kept: torch.Tensor, text: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen-Image's table: (image, text) complex angles e^(i theta), (S_image, D/2) and (S_text, D/2) -> FLUX's
    per-sample (cos, sin), each (B, S', D) over the text then the kept image tokens, each angle twice: rotating
    interleaved pairs by them is the complex product apply_rotary_emb_qwen takes."""
    image, txt = rope
    table = torch.cat([txt.expand(kept.shape[0], -1, -1), image[kept]], dim=1)
    return tuple(t.repeat_interleave(2, dim=-1) for t in (table.real, table.imag))


class PerSampleRope(FluxAttnProcessor):
    """FluxAttnProcessor that also takes one RoPE table per sample, (B, S, D) cos and sin, as routed tokens need;
    with one table for the batch (S, D) it is diffusers' own."""

    KEPT_ROPE = staticmethod(joined_rope)  # how the kept tokens' angles come from the block's table

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if _one_table(image_rotary_emb):
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        return _joint_attention(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


class PerSampleRopeFlux2(Flux2AttnProcessor):
    """Flux2AttnProcessor (FLUX.2's double-stream blocks), likewise."""

    KEPT_ROPE = staticmethod(joined_rope)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if _one_table(image_rotary_emb) or attn.fused_projections:
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        return _joint_attention(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


class PerSampleRopeParallel(Flux2ParallelSelfAttnProcessor):
    """Flux2ParallelSelfAttnProcessor (FLUX.2's single-stream blocks), likewise: the fused QKV and MLP input, attention
    over the joined stream, the fused output projection of attention and MLP."""

    KEPT_ROPE = staticmethod(joined_rope)

    def __call__(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None):
        if _one_table(image_rotary_emb):
            return super().__call__(attn, hidden_states, attention_mask, image_rotary_emb)
        qkv, mlp = attn.to_qkv_mlp_proj(hidden_states).split(
            [3 * attn.inner_dim, attn.mlp_hidden_dim * attn.mlp_mult_factor], dim=-1
        )
        q, k, v = (x.unflatten(-1, (attn.heads, -1)) for x in qkv.chunk(3, dim=-1))
        q, k = _rotate(attn.norm_q(q), image_rotary_emb), _rotate(attn.norm_k(k), image_rotary_emb)
        out = dispatch_attention_fn(
            q, k, v, attn_mask=attention_mask, backend=self._attention_backend, parallel_config=self._parallel_config
        )
        return attn.to_out(torch.cat([out.flatten(2, 3).to(q.dtype), attn.mlp_act_fn(mlp)], dim=-1))


class PerSampleRopeQwen(QwenDoubleStreamAttnProcessor2_0):
    """QwenDoubleStreamAttnProcessor2_0 (Qwen-Image's blocks), likewise: the text's mask
    (``encoder_hidden_states_mask``) joined to the image tokens' (all attended) as diffusers joins it."""

    KEPT_ROPE = staticmethod(image_text_rope)

    def __call__(
        self, attn, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None, attention_mask=None,
        image_rotary_emb=None,
    ):  # fmt: skip
        if _one_table(image_rotary_emb) or encoder_hidden_states is None or attention_mask is not None:
            return super().__call__(
                attn, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, attention_mask, image_rotary_emb
            )
        if encoder_hidden_states_mask is not None:
            image = encoder_hidden_states_mask.new_ones(hidden_states.shape[:2])
            attention_mask = torch.cat([encoder_hidden_states_mask, image], dim=1)[:, None, None, :]
        return _joint_attention(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


def _rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x (B, S, H, D) rotated by per-sample angles (cos, sin each (B, S, D)), pairs interleaved as FLUX's RoPE."""
    cos, sin = (t[:, :, None, :].to(x.device) for t in rope)
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    turned = torch.stack([-imag, real], dim=-1).flatten(3)
    return (x.float() * cos + turned.float() * sin).to(x.dtype)
