"""The `shapes` family: questions about a small drawn picture that only the picture answers (vision-language RL).

Each problem is a 56x56 RGB picture of one to three coloured shapes on a white background and one of five fixed
questions. A question's text is the same whatever the picture shows, and its answers are drawn uniformly, so a
policy beats chance only by looking at the image.
"""

from __future__ import annotations

import random

from posttrain_core.vision.images import encode_png

SIZE = 56  # pixels a side: 2x2 patches of 28 for the tiny VLM's image processor
BACKGROUND = (255, 255, 255)
COLOURS = {"red": (220, 40, 40), "green": (30, 160, 60), "blue": (40, 80, 220), "yellow": (235, 190, 20)}
SHAPES = ("circle", "square", "triangle")
QUESTIONS = {
    "colour": "What colour is the shape?",
    "shape": "What shape is it?",
    "count": "How many shapes are there?",
    "horizontal": "Is the shape on the left or the right?",
    "vertical": "Is the shape at the top or the bottom?",
}
ANSWERS = {
    "colour": tuple(COLOURS),
    "shape": SHAPES,
    "count": ("1", "2", "3"),
    "horizontal": ("left", "right"),
    "vertical": ("top", "bottom"),
}
_MARGIN = 2  # pixels kept free at the edges and on each side of the middle line, so a position is never ambiguous


def _span(rng: random.Random, size: int, side: str | None) -> int:
    """The first pixel of a shape `size` long on one axis: anywhere, or wholly in the first/second half."""
    half = SIZE // 2
    if side == "first":
        return rng.randint(_MARGIN, half - _MARGIN - size)
    if side == "second":
        return rng.randint(half + _MARGIN, SIZE - _MARGIN - size)
    return rng.randint(_MARGIN, SIZE - _MARGIN - size)


def _scene(rng: random.Random, kind: str, answer: str) -> list[tuple[str, str, int, int, int]]:
    """The shapes (shape, colour, left, top, size) of a picture whose answer to the `kind` question is `answer`."""
    if kind == "count":
        # One shape per quadrant at most: shapes never touch, so counting them is well defined.
        cells = rng.sample([(0, 0), (1, 0), (0, 1), (1, 1)], int(answer))
        scene = []
        for cx, cy in cells:
            size = rng.randint(18, 22)  # most of a 28-pixel quadrant: a tiny random-init tower learns to see it
            left = cx * SIZE // 2 + rng.randint(_MARGIN, SIZE // 2 - _MARGIN - size)
            top = cy * SIZE // 2 + rng.randint(_MARGIN, SIZE // 2 - _MARGIN - size)
            scene.append((rng.choice(SHAPES), rng.choice(tuple(COLOURS)), left, top, size))
        return scene
    shape = answer if kind == "shape" else rng.choice(SHAPES)
    colour = answer if kind == "colour" else rng.choice(tuple(COLOURS))
    size = rng.randint(20, 24)  # at most a half less its margins, for the position questions
    x_side = {"left": "first", "right": "second"}.get(answer) if kind == "horizontal" else None
    y_side = {"top": "first", "bottom": "second"}.get(answer) if kind == "vertical" else None
    return [(shape, colour, _span(rng, size, x_side), _span(rng, size, y_side), size)]


def draw(scene: list[tuple[str, str, int, int, int]]) -> bytes:
    """The picture of a scene as canonical PNG bytes (`vision.images.encode_png`)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), BACKGROUND)
    pen = ImageDraw.Draw(image)
    for shape, colour, left, top, size in scene:
        right, bottom, fill = left + size - 1, top + size - 1, COLOURS[colour]
        if shape == "circle":
            pen.ellipse((left, top, right, bottom), fill=fill)
        elif shape == "square":
            pen.rectangle((left, top, right, bottom), fill=fill)
        else:
            pen.polygon([(left, bottom), (right, bottom), (left + (size - 1) // 2, top)], fill=fill)
    return encode_png(image)


def mislabel(question: str, answer: str, rng: random.Random) -> str:
    """Another answer to `question` than `answer`, as a careless labeller gives (`synthetic.with_slips`)."""
    (kind,) = [k for k, text in QUESTIONS.items() if text == question]
    return rng.choice([a for a in ANSWERS[kind] if a != answer])


def generate(rng: random.Random) -> tuple[str, str, bytes]:
    """One problem: (question, answer, PNG bytes). The question kind, then its answer, are drawn uniformly."""
    kind = rng.choice(tuple(QUESTIONS))
    answer = rng.choice(ANSWERS[kind])
    return QUESTIONS[kind], answer, draw(_scene(rng, kind, answer))
