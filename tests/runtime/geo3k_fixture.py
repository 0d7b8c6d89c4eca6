"""A small Geometry3K-style parquet: rows {problem (with an <image> placeholder), answer, images: [{bytes, path}]}
with synthetic PNG drawings (a triangle or a circle with a digit-like mark), as data=geo3k reads them."""
import io
from pathlib import Path
from typing import List

from PIL import Image, ImageDraw

QUESTIONS = ["<image>Find x.", "How many sides does the shape have? <image>", "<image>What is the last digit of 7 3 9?"]


def _drawing(i: int) -> bytes:
    img = Image.new("RGB", (48 + 8 * (i % 4), 40 + 6 * (i % 3)), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    if i % 2:
        draw.polygon([(4, 36), (40, 36), (20 + i % 7, 4)], outline=(0, 0, 0), fill=(200, 30 * (i % 8), 40))
    else:
        draw.ellipse([6, 6, 34, 34], outline=(0, 0, 255), fill=(20 * (i % 10), 160, 90))
    draw.text((2, 2), str(i % 10), fill=(0, 0, 0))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def write_geo3k(path: Path, rows: int, seed: int = 0) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    problems: List[str] = []
    answers: List[str] = []
    images: List[list] = []
    for i in range(rows):
        k = i + seed * 1000
        problems.append(QUESTIONS[k % len(QUESTIONS)])
        answers.append(str(k % 10))
        images.append([{"bytes": _drawing(k), "path": None}])
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"problem": problems, "answer": answers, "images": images}), path)
    return path
