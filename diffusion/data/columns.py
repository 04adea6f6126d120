"""The column layout of the MDS datasets that ``data.py`` writes and the training datasets read.

Image-caption shards (``data.py convert``)::

    key               str      the source's sample key (tar member stem, file path, parquet ``key``)
    image             bytes    JPEG/PNG/WEBP bytes as they came (re-encoded JPEG when --max_size shrank it)
    caption           str
    original_width    int      the source's ``original_width``/``original_height`` when it records them
    original_height   int      (img2dataset does), else the size of the image as found
    <score>           float32  numeric metadata present in the source: pwatermark, punsafe, aesthetic,
                               similarity (and any named with --metadata); NaN for a sample that lacks it

Precomputed shards (``data.py precompute``): ``latent_moments`` (2C, h, w), ``text_embeds`` (L, D) and,
for FLUX, ``pooled_text_embeds`` (D'), all fp16 with the shape fixed in the encoding (so a dataset's
shapes are known from its index alone), plus every column above except ``image``. With ``--repa_encoder DIR``
also ``repa_features`` (E, rows, cols) fp16, the encoder's patch features, and beside the index (at the top of a
bucketed dataset) ``repa_features.json``, the record of that encoder (diffusion/techniques/repa/alignment.py encoder_identity).

Readers also accept the names other tools use: ``jpg``/``png``/``webp`` for the image and ``txt`` for the
caption.
"""

from __future__ import annotations

import re

from diffusion.batch import IMAGE  # the column is named like the batch key it becomes
from diffusion.errors import UsageError

KEY, CAPTION, ORIGINAL_WIDTH, ORIGINAL_HEIGHT = "key", "caption", "original_width", "original_height"
IMAGE_COLUMNS = (IMAGE, "jpg", "jpeg", "png", "webp")
CAPTION_COLUMNS = (CAPTION, "txt")

# Scores worth keeping when a source has them (LAION / img2dataset names), and the spellings they come in.
KNOWN_SCORES = ("pwatermark", "punsafe", "aesthetic", "similarity")
SCORE_ALIASES = {"aesthetic_score": "aesthetic", "aesthetics": "aesthetic", "clip_similarity": "similarity"}


def score_name(name: str) -> str:
    """A source's metadata name as a column name: lower case, aliases resolved."""
    name = name.strip().lower()
    return SCORE_ALIASES.get(name, name)


def scores_present(names, wanted: tuple[str, ...]) -> list[str]:
    """The wanted score columns among a source's metadata ``names``, in ``wanted`` order."""
    have = {score_name(n) for n in names}
    return [s for s in wanted if s in have]


def image_caption_columns(scores: list[str]) -> dict[str, str]:
    return {
        KEY: "str",
        IMAGE: "bytes",
        CAPTION: "str",
        ORIGINAL_WIDTH: "int",
        ORIGINAL_HEIGHT: "int",
        **{s: "float32" for s in scores},
    }


def array_encoding(shape, dtype: str = "float16") -> str:
    """An MDS ndarray encoding with dtype and shape fixed, e.g. ``ndarray:float16:8,32,32``."""
    return f"ndarray:{dtype}:{','.join(str(int(d)) for d in shape)}"


def fixed_shape(encoding: str) -> tuple[int, ...] | None:
    """The shape fixed in an ndarray encoding, or None when the shape is stored per sample."""
    m = re.fullmatch(r"ndarray:\w+:([\d,]+)", encoding)
    return tuple(int(d) for d in m.group(1).split(",")) if m else None


def dataset_columns(shards, where: str) -> dict[str, str]:
    """Column name -> encoding of an MDS dataset, the same in every shard (else a UsageError)."""
    first = dict(zip(shards[0].column_names, shards[0].column_encodings))
    for shard in shards[1:]:
        cols = dict(zip(shard.column_names, shard.column_encodings))
        if cols != first:
            raise UsageError(
                f"{where}: shard {shard.raw_data.basename} has columns {cols}, shard "
                f"{shards[0].raw_data.basename} has {first}; one dataset needs one schema "
                "(write the two kinds to different directories)"
            )
    return first


def find_column(columns, candidates: tuple[str, ...]) -> str | None:
    return next((c for c in candidates if c in columns), None)
