"""``warm_up_kernels`` loads the compiled write paths of the blend index, the match and the JSON
decoder (each with its GIL-releasing twin for long calls) and the inventory digests' step
before serving, from numba's on-disk cache when it holds them."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.test_kernel_twins import TWIN_MODULES

CHECK = f"""
import importlib, json
from kvatlas import kernel_twins
from kvatlas.directory import warm_up_kernels
from kvatlas.directory.blend import kernels
from kvatlas.directory.blend.kernels import anchors, objects, writes
from kvatlas.events import _digest_kernel, _json_cut, _json_tokens
for name in {TWIN_MODULES!r}:  # every module with twins, warmed up or not
    importlib.import_module(name)
warm_up_kernels()
cold = [k.__name__ for k in (writes.apply_op, writes.apply_ops, objects.kept_arrays,
        objects.hash_lengths, writes.apply_ops_releasing, kernels.scan, kernels.scan_releasing,
        kernels.rebuild, kernels.query_minima, kernels.query_minima_releasing,
        anchors.anchor_contents, anchors.anchor_contents_releasing, anchors.content_anchors,
        anchors.adopt_anchors,
        _json_cut._cut, _json_cut._cut_releasing, _json_tokens._parse_lists,
        _json_tokens._parse_lists_releasing, _digest_kernel.xor_into) if not k.signatures]
twins = [
    dict(
        name=t.holding.__name__,
        holding=sorted(map(str, t.holding.signatures)),
        releasing=sorted(map(str, t.releasing.signatures)),
        compiled=sum(f.stats.cache_misses.total() for f in t),
        loaded=sum(f.stats.cache_hits.total() for f in t),
    )
    for t in kernel_twins.registered()
]
print(json.dumps(dict(cold=cold, twins=twins)))
"""


def _fresh_warm_up() -> dict[str, list[object]]:
    """In a fresh process (in this one, other tests may have compiled them already)."""
    out = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, check=True, timeout=600
    )
    result: dict[str, list[object]] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_warm_up_loads_every_write_kernel_and_the_releasing_twins() -> None:
    first = _fresh_warm_up()  # compiles what the cache lacks (after an edit), fills it
    assert first["cold"] == []
    assert len(first["twins"]) >= 4
    for twin in first["twins"]:
        assert isinstance(twin, dict)
        assert twin["holding"], f"{twin['name']}: warm-up never calls it"
        assert twin["releasing"] == twin["holding"], f"{twin['name']}: twin not warmed"
    second = _fresh_warm_up()  # cold start on a warm cache: every twin loaded, none compiled
    assert second["cold"] == []
    for twin in second["twins"]:
        assert isinstance(twin, dict)
        assert twin["compiled"] == 0, f"{twin['name']}: compiled again, not loaded from the cache"
        assert twin["loaded"] == 2 * len(twin["holding"])
