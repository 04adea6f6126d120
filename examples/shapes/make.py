"""Coloured shapes on a white background, one a picture, with a caption naming colour and shape ("a red disc"):
the set on which Qwen-Image's autoencoder once learned nothing (docs/training.md). Written as a folder that
``python data.py convert FOLDER MDS --format folder`` takes (key.png with key.txt beside it).

    python examples/shapes/make.py runs/shapes/folder --count 900 --size 32
"""

import argparse
import os

import numpy as np
from PIL import Image, ImageDraw

COLOURS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (30, 60, 220), "yellow": (230, 200, 20),
           "purple": (130, 40, 170), "orange": (240, 120, 20)}  # fmt: skip
SHAPES = ("square", "disc", "triangle")


def draw(shape: str, colour: tuple, size: int, rng: np.random.Generator) -> Image.Image:
    """One shape of a random size (a third to two thirds of the picture) at a random place, on white."""
    image = Image.new("RGB", (size, size), (255, 255, 255))
    side = int(rng.integers(size // 3, 2 * size // 3 + 1))
    x, y = (int(v) for v in rng.integers(0, size - side + 1, 2))
    box = (x, y, x + side - 1, y + side - 1)
    pen = ImageDraw.Draw(image)
    if shape == "square":
        pen.rectangle(box, fill=colour)
    elif shape == "disc":
        pen.ellipse(box, fill=colour)
    else:
        pen.polygon([(x + side / 2, y), (x, y + side - 1), (x + side - 1, y + side - 1)], fill=colour)
    return image


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="folder to write (key.png + key.txt pairs)")
    p.add_argument("--count", type=int, default=900)
    p.add_argument("--size", type=int, default=32, help="pixels a side")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    os.makedirs(args.out, exist_ok=True)
    for i in range(args.count):
        colour, shape = list(COLOURS)[i % len(COLOURS)], SHAPES[(i // len(COLOURS)) % len(SHAPES)]
        draw(shape, COLOURS[colour], args.size, rng).save(os.path.join(args.out, f"{i:04d}.png"))
        with open(os.path.join(args.out, f"{i:04d}.txt"), "w") as f:
            f.write(f"a {colour} {shape}")
    print(f"shapes: {args.count} pictures of {args.size} px in {args.out}")


if __name__ == "__main__":
    main()
