"""The catch-up report's human-readable outputs: PNG charts, CSV summaries and ``report.html``.

Everything here works on small, already-collected Python data (the top
destinations, their backlog series, the writer positions, the totals), never
on DataFrames, so it runs on the driver alone and can be tested without Spark.
The HTML page is self-contained: the charts are embedded as data URIs.
"""

# tests: tests/spark/test_catch_up_report.py

from __future__ import annotations

import base64
import csv
import html
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import attrs
from matplotlib.figure import Figure

#: Columns of the per-destination table shown on the page and in destinations.csv.
TABLE_COLUMNS: Final = (
    ("destination", "destination"),
    ("pending_rooms", "pending rooms"),
    ("pending_pdus", "pending PDUs"),
    ("oldest_pending_age_s", "oldest pending"),
    ("backing_off", "backing off"),
    ("failure_ts", "failing since"),
    ("retry_interval_ms", "retry interval"),
    ("in_catch_up", "in catch-up"),
    ("catch_up_transactions", "catch-up txns"),
    ("catch_up_pdus", "catch-up PDUs"),
    ("naive_transactions", "naive txns"),
    ("naive_pdus", "naive PDUs"),
)

CHART_FILES: Final = {
    "top": "top_destinations.png",
    "backlog": "backlog_over_time.png",
    "lag": "writer_lag.png",
}


@attrs.frozen
class Totals:
    destinations: int
    in_catch_up: int
    backing_off: int
    pending_rooms: int
    pending_pdus: int
    catch_up_transactions: int
    catch_up_pdus: int
    naive_transactions: int
    naive_pdus: int
    oldest_pending_age_s: float | None

    def as_rows(self) -> list[tuple[str, object]]:
        return [(f.name, getattr(self, f.name)) for f in attrs.fields(Totals)]


@attrs.frozen
class ReportData:
    server_name: str
    source: str
    now_ms: int
    catch_up_threshold_ms: int
    totals: Totals
    #: The top destinations by pending PDUs, as dicts keyed by DESTINATIONS_SCHEMA's names.
    top: Sequence[Mapping[str, Any]]
    #: destination -> [(bucket_end_ts, backlog_pdus)], for the destinations charted.
    backlog_series: Mapping[str, Sequence[tuple[int, int]]]
    #: (stream_name, instance_name, position, furthest_position, lag)
    writers: Sequence[tuple[str, str, int, int, int]]
    #: Seconds each stage took, by name.
    timings: Mapping[str, float]
    replayed_events: int


# --- formatting ---------------------------------------------------------------------------


def format_ts(ms: int | None) -> str:
    if ms is None:
        return ""
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    s = int(seconds)
    if s < 120:
        return f"{s}s"
    if s < 2 * 3600:
        return f"{s // 60}m"
    if s < 2 * 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"


def format_cell(column: str, value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if column.endswith("_ts") and isinstance(value, int):
        return format_ts(value)
    if column == "oldest_pending_age_s" and isinstance(value, (int, float)):
        return format_duration(float(value))
    if column == "retry_interval_ms" and isinstance(value, int):
        return format_duration(value / 1000)
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


# --- charts ---------------------------------------------------------------------------------


def chart_top_destinations(top: Sequence[Mapping[str, Any]], path: Path) -> None:
    rows = [r for r in top if r["pending_pdus"] > 0][:20]
    fig = Figure(figsize=(9, max(2.5, 0.38 * len(rows) + 1.2)), dpi=100)
    ax = fig.subplots()
    if rows:
        names = [str(r["destination"]) for r in reversed(rows)]
        values = [int(r["pending_pdus"]) for r in reversed(rows)]
        colours = ["#c0392b" if r["backing_off"] else "#2980b9" for r in reversed(rows)]
        bars = ax.barh(names, values, color=colours)
        for bar, r in zip(bars, reversed(rows)):
            ax.annotate(
                f" {int(r['pending_rooms']):,} rooms",
                (bar.get_width(), bar.get_y() + bar.get_height() / 2),
                va="center",
                fontsize=8,
            )
        ax.set_xlabel("pending PDUs (red: backing off)")
    else:
        ax.text(0.5, 0.5, "no destination has pending PDUs", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("Top destinations by backlog")
    fig.tight_layout()
    fig.savefig(path)


def chart_backlog_over_time(series: Mapping[str, Sequence[tuple[int, int]]], now_ms: int, path: Path) -> None:
    fig = Figure(figsize=(9, 4.5), dpi=100)
    ax = fig.subplots()
    if series:
        for destination, points in series.items():
            # Hours before the report's "now"; the backlog holds its last value until then.
            xs = [(ts - now_ms) / 3_600_000 for ts, _ in points] + [0.0]
            ys = [value for _, value in points]
            ys.append(ys[-1])
            ax.step(xs, ys, where="post", label=destination)
        ax.legend(fontsize=8, loc="upper left")
        ax.set_ylabel("pending PDUs")
        ax.set_xlabel(f"hours before {format_ts(now_ms)}")
    else:
        ax.text(0.5, 0.5, "no backlog", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("Backlog over time (top destinations)")
    fig.tight_layout()
    fig.savefig(path)


def chart_writer_lag(writers: Sequence[tuple[str, str, int, int, int]], path: Path) -> None:
    fig = Figure(figsize=(9, max(2.5, 0.38 * len(writers) + 1.2)), dpi=100)
    ax = fig.subplots()
    if writers:
        labels = [f"{stream} / {instance}" for stream, instance, *_ in reversed(writers)]
        lags = [lag for *_, lag in reversed(writers)]
        ax.barh(labels, lags, color=["#c0392b" if lag else "#27ae60" for lag in lags])
        ax.set_xlabel("stream IDs behind the stream's furthest writer")
    else:
        ax.text(0.5, 0.5, "no stream positions", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("Stream writer lag")
    fig.tight_layout()
    fig.savefig(path)


# --- files ------------------------------------------------------------------------------------


def write_summary_csv(data: ReportData, path: Path) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["metric", "value"])
        writer.writerow(["server_name", data.server_name])
        writer.writerow(["generated_at", format_ts(data.now_ms)])
        writer.writerow(["catch_up_threshold_s", data.catch_up_threshold_ms // 1000])
        writer.writerow(["replayed_events", data.replayed_events])
        for name, value in data.totals.as_rows():
            writer.writerow([name, "" if value is None else value])


def write_destinations_csv(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], path: Path) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for row in rows:
            writer.writerow(["" if row[c] is None else row[c] for c in columns])


def _image(path: Path, alt: str) -> str:
    encoded = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{encoded}">'


def render_html(data: ReportData, charts: Mapping[str, Path]) -> str:
    t = data.totals
    saved = t.naive_transactions - t.catch_up_transactions
    cards = [
        ("destinations", f"{t.destinations:,}"),
        ("in catch-up", f"{t.in_catch_up:,}"),
        ("backing off", f"{t.backing_off:,}"),
        ("pending rooms", f"{t.pending_rooms:,}"),
        ("pending PDUs", f"{t.pending_pdus:,}"),
        ("oldest pending", format_duration(t.oldest_pending_age_s) or "none"),
        ("catch-up transactions", f"{t.catch_up_transactions:,} ({t.catch_up_pdus:,} PDUs)"),
        ("naive replay transactions", f"{t.naive_transactions:,} ({t.naive_pdus:,} PDUs)"),
    ]
    card_html = "\n".join(
        f'<div class="card"><div class="v">{html.escape(v)}</div><div class="k">{html.escape(k)}</div></div>'
        for k, v in cards
    )
    head = "".join(f"<th>{html.escape(label)}</th>" for _, label in TABLE_COLUMNS)
    body = "\n".join(
        "<tr>"
        + "".join(
            f'<td class="{"l" if c == "destination" else "n"}">{html.escape(format_cell(c, row[c]))}</td>'
            for c, _ in TABLE_COLUMNS
        )
        + "</tr>"
        for row in data.top
    )
    writer_rows = "\n".join(
        f'<tr><td class="l">{html.escape(s)}</td><td class="l">{html.escape(i)}</td>'
        f'<td class="n">{p:,}</td><td class="n">{f:,}</td><td class="n">{lag:,}</td></tr>'
        for s, i, p, f, lag in data.writers
    )
    timings = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in data.timings.items())
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>Catch-up report: {html.escape(data.server_name)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }}
h1 {{ font-size: 1.5em; margin-bottom: 0.2em; }} .meta {{ color: #666; font-size: 0.9em; }}
.cards {{ display: flex; flex-wrap: wrap; gap: 0.8em; margin: 1.2em 0; }}
.card {{ border: 1px solid #ddd; border-radius: 6px; padding: 0.6em 1em; min-width: 9em; }}
.card .v {{ font-size: 1.3em; font-weight: 600; }} .card .k {{ color: #666; font-size: 0.85em; }}
table {{ border-collapse: collapse; font-size: 0.85em; margin-bottom: 1.5em; }}
th, td {{ border-bottom: 1px solid #eee; padding: 0.25em 0.6em; }} th {{ background: #f5f5f5; text-align: left; }}
td.n {{ text-align: right; font-variant-numeric: tabular-nums; }} td.l {{ text-align: left; }}
img {{ max-width: 100%; display: block; margin: 0.5em 0 1.5em; }}
</style></head><body>
<h1>Federation catch-up report: {html.escape(data.server_name)}</h1>
<div class="meta">As of {html.escape(format_ts(data.now_ms))}; catch-up threshold
{html.escape(format_duration(data.catch_up_threshold_ms / 1000))}; {data.replayed_events:,} local events replayed
from {html.escape(data.source)}. Stages: {html.escape(timings)}.</div>
<div class="cards">{card_html}</div>
<p>A catch-up that sends each pending room's forward extremities needs
<b>{t.catch_up_transactions:,}</b> transactions ({t.catch_up_pdus:,} PDUs); replaying every missed PDU needs
<b>{t.naive_transactions:,}</b> ({t.naive_pdus:,} PDUs): {saved:,} transactions fewer.</p>
<h2>Top destinations by backlog</h2>
{_image(charts["top"], "Top destinations by backlog")}
<table><thead><tr>{head}</tr></thead><tbody>
{body}
</tbody></table>
<h2>Backlog over time</h2>
{_image(charts["backlog"], "Backlog over time")}
<h2>Stream writers</h2>
{_image(charts["lag"], "Stream writer lag")}
<table><thead><tr><th>stream</th><th>writer</th><th>position</th><th>furthest writer</th><th>lag</th></tr></thead>
<tbody>
{writer_rows}
</tbody></table>
</body></html>
"""


def write_report(data: ReportData, out_dir: Path) -> dict[str, Path]:
    """Write the charts, summary.csv and report.html into ``out_dir``; return their paths."""
    charts = {key: out_dir / name for key, name in CHART_FILES.items()}
    chart_top_destinations(data.top, charts["top"])
    chart_backlog_over_time(data.backlog_series, data.now_ms, charts["backlog"])
    chart_writer_lag(data.writers, charts["lag"])
    summary = out_dir / "summary.csv"
    write_summary_csv(data, summary)
    page = out_dir / "report.html"
    page.write_text(render_html(data, charts), encoding="utf-8")
    return {**charts, "summary": summary, "html": page}
