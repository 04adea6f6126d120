"""diffusion/sharding.py: which modules become FSDP units."""

from diffusion.sharding import mark_fsdp_units, outermost_blocks


def test_outermost_blocks_found_from_the_tree_alone(sd_tiny):
    m = sd_tiny.model
    mid = m.unet.mid_block  # not in a list itself: its own repeated parts are the units
    assert outermost_blocks(m.unet) == (
        set(m.unet.down_blocks) | set(m.unet.up_blocks) | set(mid.resnets) | set(mid.attentions)
    )
    # CLIP's layer list: text_model.encoder.layers in transformers 4, encoder.layers in 5
    (layers,) = [mod for name, mod in m.text_encoder.named_modules() if name.endswith("encoder.layers")]
    assert outermost_blocks(m.text_encoder) == set(layers)


def test_only_trainable_children_are_sharded(sd_tiny):
    m = sd_tiny.model
    assert mark_fsdp_units(m) == ["unet"]
    assert m.vae._fsdp_wrap is False and m.text_encoder._fsdp_wrap is False
    assert m.unet.fsdp_wrap_fn(m.unet.down_blocks[0]) and not m.unet.fsdp_wrap_fn(m.unet.conv_in)
