"""Live and virtual agree on one short trace segment (spec fleet-routing §4; issue 27 item 5):
hit ratio within 2 points, TTFT percentiles within 15%. That agreement is what makes the
virtual numbers believable; if they disagree, the model is what gets fixed, not the tolerance.

The segment: RAG requests (documents of 2–4k tokens reused at other offsets, so prefix and
fragment reuse, the connector, the coordinator's scoring and the KV events all take part) on
two engines under the full kvatlas stack, at a load where requests queue a little.

The speed: live model time is wall time × speed, so every wall millisecond that is not the
engine's modelled work (the router, the HTTP hops, the connector's node calls, the engine's
own Python per step) counts × speed. Measured on this segment (2 cores shared, load average
15–21; ``kvatlas.bench.fleet.live`` prints it as "TTFT outside the engines"): 5.0 ms model per
request at speed 0.1 (1.7% of the mean TTFT, 301 ms), 17.6 ms at 0.25 (5.6%), 291 ms at 1
(42%, and the hit ratio falls from 0.54 to 0.43), 3.7 s at 4 (85%). At 0.1 both modes route
every request to the same engine, the hit ratio and fragment tokens are equal and the TTFT
percentiles are 0.2–2.7% apart (docs/fleet-live.md). The segment's 2 model seconds take about
25 wall seconds, plus the fleet's start.

The router scrapes the engines' gauges every 10 model ms here (``SCRAPE_S``), in both modes.
At its default (every model second) the live router's timer has whatever phase the fleet's
start left it, against the virtual one's scrapes at 0, 1, 2 s of the trace; request 6 of this
segment arrives 28 ms after the virtual scrape of 1 s and its engine choice hinges on the gauges:
live went the other way in 2 of 3 runs on a quiet machine (TTFT p50 0.20 against 0.30 s, on
the code before and after issue 31's last change alike), and agreed in 4 of 4 scraping every
10 ms. Scraped that often, both modes see gauges at most 10 ms old at every decision.

No assertion on a duration: the tolerances compare model times.
"""

from __future__ import annotations

from kvatlas.bench.fleet import live, virtual
from kvatlas.bench.fleet.config import FleetConfig
from kvatlas.bench.fleet.results import summarize
from kvatlas.bench.fleet.stacks import STACKS
from kvatlas.workloads import open_workload

SEGMENT = "rag:docs=8,k=3,zipf=1.0,rate=6,seed=3,doc_min=2048,doc_max=4096,output=8"
REQUESTS = 12
SPEED = 0.1
HIT_POINTS = 0.02
TTFT_SHARE = 0.15
SCRAPE_S = 0.01


def test_live_and_virtual_agree_on_one_segment() -> None:
    stack = STACKS["kvatlas"]
    config = FleetConfig(trace=SEGMENT, stacks=(stack,), engines=2, requests=REQUESTS,
                         speed=SPEED, metrics_interval_s=SCRAPE_S)  # fmt: skip
    requests = list(open_workload(SEGMENT, REQUESTS))
    lines: list[str] = []
    by_mode = {
        "virtual": virtual.run_stack(config, stack, requests, lines.append),
        "live": live.run_stack(config, stack, requests, lines.append),
    }
    for mode, records in by_mode.items():
        assert sorted(r.index for r in records) == [r.index for r in requests], mode
    v, lv = summarize(by_mode["virtual"]), summarize(by_mode["live"])
    report = f"virtual {v}\nlive {lv}\n" + "\n".join(lines)
    assert v.hit_ratio > 0.2, report  # the segment reuses: the comparison means something
    assert abs(lv.hit_ratio - v.hit_ratio) <= HIT_POINTS, report
    for name in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s"):
        want, got = getattr(v, name), getattr(lv, name)
        assert abs(got - want) <= TTFT_SHARE * want, f"{name}: virtual {want}, live {got}\n{report}"
