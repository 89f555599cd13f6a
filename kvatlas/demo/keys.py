"""``kvatlas demo --keys``: multimodal-safe keys at work (docs/keys.md, "Running").

One prompt with two different images, and the same image twice: the image chunks differ, the
text before them is shared, and the same image gives the same keys.
"""

from __future__ import annotations

import time

import numpy as np
from rich.console import Console
from rich.table import Table

from kvatlas.keys import MMItem, RequestTracker, chunk_hashes

CHUNK = 256
IMAGE_TOKEN = 151_655  # a typical "<image_pad>" placeholder id
IMAGE_SPAN = (300, 1024)  # offset, length: straddles chunk boundaries


def _prompt(rng: np.random.Generator) -> list[int]:
    text: list[int] = rng.integers(0, 150_000, 2048).tolist()
    offset, length = IMAGE_SPAN
    text[offset : offset + length] = [IMAGE_TOKEN] * length
    return text


def _image_chunks() -> range:
    offset, length = IMAGE_SPAN
    return range(offset // CHUNK, -(-(offset + length) // CHUNK))


def run_demo(seed: int = 0) -> int:
    console = Console(width=max(Console().width, 120))
    prompt = _prompt(np.random.default_rng(seed))
    offset, length = IMAGE_SPAN
    requests = {
        "text + cat.png": "sha256:cat-photo",
        "text + dog.png": "sha256:dog-photo",
        "text + cat.png again": "sha256:cat-photo",
    }
    RequestTracker(prompt, [MMItem.of("warm-up", offset, length)]).chunk_hashes()  # load kernels
    start = time.perf_counter()
    keys = {
        name: RequestTracker(prompt, [MMItem.of(image, offset, length)]).chunk_hashes()
        for name, image in requests.items()
    }
    elapsed = time.perf_counter() - start
    raw = chunk_hashes(prompt, CHUNK)

    table = Table(
        title=f"chunk hashes of a {len(prompt)}-token prompt, image span [{offset}, {offset + length})"
    )
    table.add_column("chunk")
    table.add_column("covers image")
    for name in [*requests, "cat or dog, keyed by raw placeholders"]:
        table.add_column(name)
    image_chunks = _image_chunks()
    for i in range(len(raw)):
        row = [str(i), "yes" if i in image_chunks else ""]
        row += [keys[name][i].hex()[:16] for name in requests]
        row.append(raw[i].hex()[:16])
        table.add_row(*row)
    console.print(table)

    cat, dog, cat_again = (keys[name] for name in requests)
    differ = all(cat[i] != dog[i] for i in image_chunks if i < len(cat))
    text_before_same = all(cat[i] == dog[i] for i in range(image_chunks.start))
    same_twice = cat == cat_again
    console.print(f"same text, different images → image chunks differ: [bold]{differ}[/bold]")
    console.print(f"chunks before the image are shared by both: [bold]{text_before_same}[/bold]")
    console.print(f"same image twice → identical keys: [bold]{same_twice}[/bold]")
    console.print(
        f"timing: 3 requests substituted and hashed in {elapsed * 1e3:.2f} ms "
        f"({len(prompt) * 3 / elapsed / 1e6:.1f} M tokens/s; `kvatlas bench keys` for 128k prompts)"
    )
    return 0 if differ and same_twice and text_before_same else 1
