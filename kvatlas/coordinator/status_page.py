"""The status page's HTML: one self-contained page (``status_page.html``: styles and a small
script, no external resource) around a body rendered here from a
:class:`~kvatlas.coordinator.status.StatusView`.

Invariant: every string that reaches the page passes through :func:`_e` (instance ids,
backends and every other client-supplied text are HTML-escaped, attribute-safe); numbers are
formatted here. The script only swaps in bodies this module rendered
(``GET /status/fragment``), so escaping happens in one place. A Content-Security-Policy with a
per-response nonce keeps any script but the page's own from running. See docs/operator.md.
"""

from __future__ import annotations

import html
import secrets
import time
from collections.abc import Sequence
from importlib import resources
from string import Template

from kvatlas.coordinator.cache_control.status import CacheControlStatus, OpenCommand, QuotaRow
from kvatlas.coordinator.status import FleetRow, StatusView
from kvatlas.coordinator.views import Readiness

REFRESH_S = 5
_TEMPLATE = Template(
    resources.files("kvatlas.coordinator").joinpath("status_page.html").read_text("utf-8")
)
_SPARK_W, _SPARK_H = 130, 26


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def page(body: str | None) -> tuple[str, str]:
    """The whole page and its CSP header; ``body`` ``None``: the shell that asks for a
    token and fetches the body with it (auth on: the page itself shows no data)."""
    nonce = secrets.token_urlsafe(16)
    shell = body is None
    text = _TEMPLATE.substitute(
        nonce=nonce,
        body=body if body is not None else _NEEDS_TOKEN,
        updated="" if shell else f"rendered {_e(time.strftime('%H:%M:%S'))}",
        refresh_s=REFRESH_S,
        refresh_ms=REFRESH_S * 1000,
        needs_token="true" if shell else "false",
    )
    csp = (
        f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; "
        "style-src-attr 'unsafe-inline'; "
        "connect-src 'self'; img-src data:; form-action 'none'; base-uri 'none'; "
        "frame-ancestors 'none'"
    )
    return text, csp


_NEEDS_TOKEN = (
    '<div class="card" id="login"><h2>Token needed</h2><p>This coordinator has auth on. '
    "The page asks for an admin token (or a lookup token bound to no cache salts) with "
    "JavaScript on; without it, read <code>/status.json</code> with a bearer token.</p></div>"
)


# ---------------------------------------------------------------------------- formatting


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _pct(r: float | None) -> str:
    return "–" if r is None else f"{100 * r:.1f}%"


def _secs(s: float | None) -> str:
    if s is None:
        return "–"
    if s < 1:
        return f"{s * 1000:.1f} ms" if s < 0.1 else f"{s * 1000:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    return f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"


def _rate(r: float) -> str:
    return f"{r:,.1f}/s"


def _num(n: int) -> str:
    return f"{n:,}"


def _kv(rows: Sequence[tuple[str, str]]) -> str:
    cells = "".join(f"<dt>{_e(k)}</dt><dd>{v}</dd>" for k, v in rows)
    return f'<dl class="kv">{cells}</dl>'


def _card(title: str, inner: str, element_id: str) -> str:
    return f'<section class="card" id="{element_id}"><h2>{_e(title)}</h2>{inner}</section>'


def _spark(points: Sequence[float | None]) -> str:
    """An inline SVG of ratios in [0, 1]; a minute without data breaks the line; nothing at
    all (no empty box) until some minute has data."""
    if all(v is None for v in points):
        return ""
    n = max(len(points) - 1, 1)
    lines: list[list[str]] = [[]]
    for i, v in enumerate(points):
        if v is None:
            if lines[-1]:
                lines.append([])
            continue
        x = i * _SPARK_W / n
        y = (1 - min(max(v, 0.0), 1.0)) * (_SPARK_H - 2) + 1
        lines[-1].append(f"{x:.1f},{y:.1f}")
    shapes = "".join(
        f'<polyline points="{" ".join(p)}"/>' if len(p) > 1 else _dot(p[0]) for p in lines if p
    )
    return (
        f'<svg viewBox="0 0 {_SPARK_W} {_SPARK_H}" preserveAspectRatio="none" role="img" '
        f'aria-label="last hour, per minute">{shapes}</svg>'
    )


def _dot(point: str) -> str:
    x, y = point.split(",")
    return f'<circle cx="{x}" cy="{y}" r="2"/>'


def _bar(used: int, capacity: int) -> str:
    if capacity <= 0:
        return f'<span class="muted">{_e(_bytes(used))}</span>' if used else "–"
    share = min(used / capacity, 1.0)
    label = f"{_bytes(used)} / {_bytes(capacity)}"
    return (
        f'<span class="bar" title="{_e(label)}"><span style="width:{100 * share:.1f}%"></span>'
        f"</span>{_e(label)}"
    )


# ---------------------------------------------------------------------------- sections


def _value(view: StatusView) -> str:
    r, s, v = view.ratios, view.sparklines, view.value
    rows = (
        ("prefix hit rate", r.prefix_hit_rate, s.prefix_hit_rate, "prefix", ""),
        ("fragment hit rate", r.fragment_hit_rate, s.fragment_hit_rate, "fragment", ""),
        ("regret ratio", r.regret_ratio, s.regret_ratio, "regret", " regret"),
    )
    inner = "".join(
        f'<div class="spark{cls}"><span>{_e(label)}<br><span class="big" id="{key}-ratio">'
        f"{_e(_pct(ratio))}</span></span>{_spark(points)}</div>"
        for label, ratio, points, key, cls in rows
    )
    inner += (
        f'<div class="muted">{_e(_num(v.query_tokens))} query tokens, '
        f"{_e(_num(v.blend_query_tokens))} blend query tokens, "
        f"{_e(_num(v.recomputed_tokens))} recomputed, {_e(_num(v.regret_tokens))} of them held "
        "by another instance</div>"
    )
    return _card("Value (per minute, last hour)", inner, "value")


def _traffic(view: StatusView) -> str:
    t = view.traffic
    return _card(
        f"Traffic (last {t.window_s:.0f} s)",
        _kv(
            [
                ("events/s", _e(_rate(t.events_per_s))),
                ("lookups/s", _e(_rate(t.lookups_per_s))),
                ("blend lookups/s", _e(_rate(t.blend_lookups_per_s))),
                ("lookup p50", _e(f"≤{_secs(t.lookup_p50_s)}")),
                ("lookup p99", _e(f"≤{_secs(t.lookup_p99_s)}")),
                ("blend p50", _e(f"≤{_secs(t.blend_p50_s)}")),
                ("blend p99", _e(f"≤{_secs(t.blend_p99_s)}")),
            ]
        ),
        "traffic",
    )


def _directory(view: StatusView) -> str:
    d = view.directory
    total_bytes = sum(d.bytes_by_tier.values())
    rows = [
        ("keys", _e(_num(d.keys))),
        ("placements", _e(_num(d.placements))),
        ("chunks", _e(_num(d.chunks))),
        ("with known tokens", _e(_num(d.bound_chunks))),
        ("bytes per chunk", _e(_bytes(total_bytes / d.placements) if d.placements else "–")),
    ]
    rows += [
        (f"{tier.upper()} bytes", _e(_bytes(n))) for tier, n in sorted(d.bytes_by_tier.items())
    ]
    return _card("Directory", _kv(rows), "directory")


def _blend(view: StatusView) -> str:
    b = view.directory.blend
    if b is None:
        return _card("Blend index", '<p class="muted">blend lookup off</p>', "blend")
    per_chunk = b.index_bytes / b.contents if b.contents else None
    rows = [
        ("contents", _e(_num(b.contents))),
        ("occupants", _e(_num(b.occupants))),
        ("namespaces", _e(_num(b.namespaces))),
        ("index bytes", _e(_bytes(b.index_bytes))),
        ("bytes per chunk", _e("–" if per_chunk is None else f"{per_chunk:.0f} B")),
        ("token bytes", _e(_bytes(b.token_bytes))),
    ]
    return _card("Blend index", _kv(rows), "blend")


def _service(view: StatusView) -> str:
    ok = view.readiness is Readiness.SERVING
    pill = f'<span class="pill {"ok" if ok else "warn"}" id="readiness">{_e(view.readiness.value)}</span>'
    snap = view.snapshot
    rows = [
        ("readiness", pill),
        ("hash scheme", _e(view.hash_scheme)),
        ("version", _e(view.version)),
    ]
    rows.append(("events via", _e(view.event_transport)))
    if view.stream_length is not None:
        rows.append(("stream length", _e(_num(view.stream_length))))
    if snap is None:
        where = view.snapshot_path or "no --snapshot-path"
        rows.append(("last snapshot", f'<span class="muted">none yet ({_e(where)})</span>'))
    else:
        rows += [
            ("last snapshot", _e(f"{_secs(snap.age_s)} ago")),
            ("duration / pause", _e(f"{_secs(snap.seconds)} / {_secs(snap.max_pause_s)}")),
            ("keys in it", _e(_num(snap.keys))),
        ]
    return _card("Coordinator", _kv(rows), "service")


_FLEET_HEAD = (
    "<tr><th>instance</th><th>state</th><th>backend</th><th>heartbeat</th><th>last event</th>"
    "<th>incarnation</th><th>gaps</th><th>lag</th><th>L1</th><th>L2</th><th>chunks L1 / L2</th>"
    "<th>L1 placements</th></tr>"
)


def _fleet_row(row: FleetRow) -> str:
    em, tiers = row.emitter, row.tiers
    state = (
        '<span class="pill ok">alive</span>'
        if row.alive
        else '<span class="pill bad">fenced</span>'
    )
    chunks = "–" if tiers is None else f"{_num(tiers.l1_chunks)} / {_num(tiers.l2_chunks)}"
    cells = [
        f'<td class="id" title="{_e(row.instance_id)}">{_e(row.instance_id)}</td>',
        f"<td>{state}</td>",
        f"<td>{_e(row.backend or '–')}</td>",
        f"<td>{_e(_secs(row.heartbeat_age_s))}</td>",
        f"<td>{_e(_secs(row.event_age_s))}</td>",
        _incarnation(em.incarnation),
        f"<td>{_e(_num(em.gaps))}</td>",
        f"<td>{_e(_secs(em.event_delivery_delay_seconds))}</td>",
        f"<td>{'–' if tiers is None else _bar(tiers.l1_bytes, tiers.l1_capacity_bytes)}</td>",
        f"<td>{'–' if tiers is None else _bar(tiers.l2_bytes, tiers.l2_capacity_bytes)}</td>",
        f"<td>{_e(chunks)}</td>",
        f"<td>{_e(_num(row.l1_placements))}</td>",
    ]
    return f"<tr>{''.join(cells)}</tr>"


def _incarnation(value: int | None) -> str:
    """The last 6 digits (an incarnation is a start time in ns); the whole on hover."""
    if value is None:
        return "<td>–</td>"
    return f'<td title="{_e(value)}">…{_e(str(value)[-6:])}</td>'


def _fleet(view: StatusView) -> str:
    alive = sum(1 for r in view.fleet if r.alive)
    title = f"<h3>Fleet: {alive} alive, {len(view.fleet) - alive} fenced</h3>"
    if not view.fleet:
        return title + '<p class="muted" id="fleet">no instance has registered or emitted yet</p>'
    rows = "".join(_fleet_row(r) for r in view.fleet)
    return f'{title}<table id="fleet"><thead>{_FLEET_HEAD}</thead><tbody>{rows}</tbody></table>'


def _recent(view: StatusView) -> str:
    """Faults and repairs since start, newest first, with their UTC times."""
    rows = "".join(
        f'<li class="event {_e(e.kind)}"><time>'
        f"{_e(time.strftime('%H:%M:%S', time.gmtime(e.at)))}</time> {_e(e.detail)}</li>"
        for e in view.recent
    )
    return _card("recent events (UTC)", f'<ul class="events">{rows}</ul>', "recent")


def render_body(view: StatusView) -> str:
    """The page's body (also ``GET /status/fragment``)."""
    cards = (
        _value(view) + _traffic(view) + _directory(view) + _blend(view) + _service(view)
        + _recent(view)
    )  # fmt: skip
    cache = "" if view.cache_control is None else _cache_control(view.cache_control)
    return f'<div class="grid">{cards}</div>{_fleet(view)}{cache}'


# ---------------------------------------------------------------------------- cache control


def _salt(salt: str) -> str:
    """A salt as its paths name it (``_default`` the empty one, in italics)."""
    if not salt:
        return '<td class="id" title="the empty salt"><i>_default</i></td>'
    return f'<td class="id" title="{_e(salt)}">{_e(salt)}</td>'


def _quota_row(row: QuotaRow) -> str:
    limit = row.limit_bytes
    if limit is None:
        limit_text, used, share = "none", _e(f"{_bytes(row.usage_bytes)} (exempt)"), "–"
    elif limit == 0:
        limit_text, used = "0 B", _e(_bytes(row.usage_bytes))
        share = "over" if row.usage_bytes else "–"
    else:
        limit_text, used = _bytes(limit), _bar(row.usage_bytes, int(limit))
        share = _pct(row.usage_bytes / limit)
    cells = [
        _salt(row.cache_salt),
        f'<td>{_e(limit_text)} <span class="muted">{"own" if row.own else "default"}</span></td>',
        f"<td>{used}</td>",
        f'<td class="{"over" if _over(row) else ""}">{_e(share)}</td>',
        f"<td>{_e(_num(row.pinned_keys))}</td>",
    ]
    return f"<tr>{''.join(cells)}</tr>"


def _over(row: QuotaRow) -> bool:
    return (
        row.limit_bytes is not None and row.usage_bytes > 0 and row.usage_bytes >= row.limit_bytes
    )


_QUOTA_HEAD = (
    "<tr><th>cache salt</th><th>limit</th><th>L2 usage</th><th>used</th><th>pinned keys</th></tr>"
)


def _cache_control(cc: CacheControlStatus) -> str:
    default = (
        "none: salts without a quota are exempt"
        if cc.default_limit_bytes is None
        else _bytes(cc.default_limit_bytes)
    )
    shown = "" if cc.salts <= len(cc.quotas) else f", the {len(cc.quotas)} most used shown"
    title = (
        f"<h3>Quotas: {_e(_num(cc.salts))} salts{_e(shown)}; default {_e(default)}"
        f' <span class="muted">(usage counted {_e(_secs(cc.usage_age_s))} ago)</span></h3>'
    )
    if cc.quotas:
        rows = "".join(_quota_row(r) for r in cc.quotas)
        quotas = f'<table id="quotas"><thead>{_QUOTA_HEAD}</thead><tbody>{rows}</tbody></table>'
    else:
        quotas = '<p class="muted" id="quotas">no salt holds L2 bytes, a quota or a pin yet</p>'
    pins = _card(
        "Pins",
        _kv([("pinned keys", _e(_num(cc.pinned_keys))),
             ("pinned bytes", _e(_bytes(cc.pinned_bytes)))]),
        "pins",
    )  # fmt: skip
    counts = {(c.kind, c.state): c.count for c in cc.commands}
    kinds, states = (list(dict.fromkeys(k[i] for k in counts)) for i in (0, 1))
    head = "<tr><th>command</th>" + "".join(f"<th>{_e(s)}</th>" for s in states) + "</tr>"
    body = "".join(
        f"<tr><td>{_e(kind)}</td>"
        + "".join(f"<td>{_e(_num(counts[kind, s]))}</td>" for s in states)
        + "</tr>"
        for kind in kinds
    )
    commands = _card(
        "Commands by kind and state",
        f'<table id="commands"><thead>{head}</thead><tbody>{body}</tbody></table>',
        "command-counts",
    )
    return f'{title}{quotas}<div class="grid cache">{pins}{commands}{_unfinished(cc)}</div>'


def _phase(c: OpenCommand) -> str:
    """A move's phase and progress (``–``: another kind has none)."""
    m = c.move
    if m is None:
        return "–"
    return (
        f"{m.phase}: {_num(m.loaded)} loaded, {_num(m.missing)} missing, "
        f"{_num(m.deleted)} deleted, {_num(m.skipped)} skipped"
    )


def _unfinished(cc: CacheControlStatus) -> str:
    if not cc.unfinished:
        inner = '<p class="muted">none: every command is done</p>'
    else:
        rows = "".join(
            f'<tr><td class="id" title="{_e(c.command_id)}">{_e(c.command_id[:12])}</td>'
            f"<td>{_e(c.kind)}</td><td>{_e(', '.join(c.targets))}</td><td>{_e(_num(c.keys))}</td>"
            f"<td>{_e(c.state)}</td><td>{_e(_phase(c))}</td><td>{_e(_num(c.attempts))}</td>"
            f"<td>{_e(_secs(c.age_s))}</td>"
            f'<td class="error" title="{_e(c.last_error)}">{_e(c.last_error or "–")}</td></tr>'
            for c in cc.unfinished
        )
        head = (
            "<tr><th>id</th><th>kind</th><th>to</th><th>keys</th><th>state</th><th>phase</th>"
            "<th>attempts</th><th>age</th><th>last error</th></tr>"
        )
        inner = f"<table><thead>{head}</thead><tbody>{rows}</tbody></table>"
    more = (
        "" if cc.unfinished_total <= len(cc.unfinished) else f", oldest {len(cc.unfinished)} shown"
    )
    return _card(f"Unfinished commands ({cc.unfinished_total}{more})", inner, "unfinished")
