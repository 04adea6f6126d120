"""Text-to-image diffusion training recipes on MosaicML Composer."""

__version__ = "0.1.0"
