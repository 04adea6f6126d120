"""The aspect-ratio bucket table and its names (``4x3``, ``1x2``): data, at the bottom of the package, so the
settings declaration (config.py, ``synthetic_buckets``) checks a bucket list without importing data/, and
data/buckets.py sizes and splits datasets by it. Standard library only."""

from __future__ import annotations

# (width units, height units): 1:4 ... 1:1 ... 4:1, about evenly spaced in log ratio.
ASPECTS = (
    (1, 4),
    (1, 3),
    (2, 5),
    (1, 2),
    (4, 7),
    (2, 3),
    (3, 4),
    (1, 1),
    (4, 3),
    (3, 2),
    (7, 4),
    (2, 1),
    (5, 2),
    (3, 1),
    (4, 1),
)


def name(aspect: tuple[int, int]) -> str:
    return f"{aspect[0]}x{aspect[1]}"


def parse_name(text: str) -> tuple[int, int]:
    w, _, h = text.partition("x")
    return int(w), int(h)


def names_of(text: str) -> list[str]:
    """Bucket names from a setting's text: ``all`` (the whole table) or a comma list such as ``1x1,2x1,1x2``."""
    if text.strip() == "all":
        return [name(a) for a in ASPECTS]
    return [n.strip() for n in text.split(",") if n.strip()]


def bucket_names_problem(text: str) -> str | None:
    """What is wrong with a bucket list (None: every name is in the table): the synthetic_buckets rule."""
    known = {name(a) for a in ASPECTS}
    unknown = [n for n in names_of(str(text)) if n not in known]
    if unknown or not names_of(str(text)):
        return f"is not 'all' or a comma list of buckets from {', '.join(sorted(known))}"
    return None
