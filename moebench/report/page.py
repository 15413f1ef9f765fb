"""`moebench report RUN_DIR... -o FILE.html|FILE.md`: one page of one or more runs, made from what they stored.

For every run: how its points were timed (moebench.report.table.timing_statement: an interpreter or host-clock
run is flagged as not GPU figures), then its headline (a serving_trace run's padding-tax table,
moebench.report.trace_tax, and the headline numbers its sweep declares, moebench.report.headline, computed from the
records), the manifest (GPU, driver, CUDA, torch, Triton, DeepEP, commit, command, when), its table (the columns,
names and number formats of the table `moebench run` prints, with each point's fraction of the GEMM ceiling where
the run timed one: moebench.report.ceiling), the notes `moebench run` prints under its table (failures, skips, the
GEMM ceiling, each impl against the best peer) and its figures.
HTML is one self-contained file: the PNGs are embedded as data URIs, the style is inline, nothing is fetched.
Markdown (for a pull request) links the PNGs by their path relative to the output file instead.

A run directory holding profiles (`moebench profile ... --out RUN_DIR` writes <run_dir>/profile-*/profile.json),
or a profile's own folder, also gets the profile's per-stage breakdown: one row per NVTX range (the point's, then
its pipeline stages), count, host and device time per call, share of the point's device time, top kernels.

Figures are found where `moebench plot` puts them, else drawn from the records (moebench.report.figures).
Bad input (not a run directory, a run without records, an output that cannot be written or of another kind) is a
`ReportError`: one line, nothing written.
"""

from __future__ import annotations

import base64
import html
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moebench.report import capture_search as capture_search_report, cells, trace_tax
from moebench.report.ceiling import ceiling_rows
from moebench.report.figures import draw_plots, find_plots, scratch_dir_for
from moebench.report.describe import description_line
from moebench.report.headline import HeadlineRow, evaluate, side_text
from moebench.report.peers import MODES_DIFFER, peer_ratios, ratio_text
from moebench.report.table import (METRICS, column_notes, metric_title, param_cell, status_lines, timed_call_line,
                                   timing_statement)
from moebench.records import MANIFEST, RECORDS, load_records

PROFILE = "profile.json"  # what moebench profile writes in its folder (moebench.profile.driver.profile_point)
TOP_KERNELS = 3
FORMATS = (".html", ".md")
MAX_REASON = 90  # characters of a failure reason in a table cell
CEILING_CAPTION = ("torch's two expert GEMMs alone (rows sorted by expert, no glue) at each point, on its own "
                   "routing and on equal groups: 'of ceiling' = ceiling / p50 (1: as fast as the GEMMs alone), "
                   "uneven cost = own-routing / equal-group ceiling.")
PEER_CAPTION = ("Each impl's p50 over the fastest other peer's p50 at the same point (peers: torch.compile, "
                "library adapters, plugins): below 1, faster than every peer.")


class ReportError(ValueError):
    """Input or output the report cannot use. str() is the one line shown."""


@dataclass
class RunView:
    path: Path
    manifest: dict
    records: list[dict]
    headlines: list[HeadlineRow]
    plots: list[Path] = field(default_factory=list)
    profiles: list[dict] = field(default_factory=list)  # profile.json contents, "_dir" set to their folder
    plot_note: str = ""  # where the figures were drawn from the records, or why none could be

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def sweep(self) -> dict:
        return self.manifest.get("sweep") or {}


def find_profiles(run_dir: Path) -> list[dict]:
    """The profiles of a run directory: its own profile.json (a profile's folder), then those one folder down."""
    out = []
    for path in [run_dir / PROFILE, *sorted(run_dir.glob(f"*/{PROFILE}"))]:
        if not path.is_file():
            continue
        try:
            prof = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ReportError(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from None
        if isinstance(prof, dict):
            out.append({**prof, "_dir": path.parent.name})
    return out


def load_run(run_dir: str | Path) -> RunView:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: not a run directory (no such directory)")
    profiles = find_profiles(run_dir)
    if not (run_dir / RECORDS).exists() and profiles:
        return RunView(run_dir, {}, [], [], find_plots(run_dir), profiles)  # a profile's own folder
    if not (run_dir / RECORDS).exists():
        raise ReportError(f"{run_dir}: not a run directory (no {RECORDS})")
    records = sorted(load_records(run_dir), key=lambda r: r.get("point", 0))
    if not records:
        raise ReportError(f"{run_dir}: empty run (no records in {RECORDS})")
    manifest: dict = {}
    if (run_dir / MANIFEST).exists():
        try:
            manifest = json.loads((run_dir / MANIFEST).read_text())
        except json.JSONDecodeError as e:
            raise ReportError(f"{run_dir / MANIFEST}: not valid JSON ({e.msg}, line {e.lineno})") from None
    specs = (manifest.get("sweep") or {}).get("headlines") or []
    return RunView(run_dir, manifest, records, evaluate(records, specs), find_plots(run_dir), profiles)


# ---------------------------------------------------------------------------------------------------------------
# What each run shows
# ---------------------------------------------------------------------------------------------------------------

def manifest_items(run: RunView) -> list[tuple[str, str]]:
    m, env = run.manifest, run.manifest.get("env") or {}
    gpu = env.get("gpu")
    if gpu:
        gpu = f"{gpu} x{env.get('gpu_count', 1)}" + (f", {env['gpu_memory_gib']} GiB" if env.get("gpu_memory_gib")
                                                    else "")
    items = [("sweep", f"{run.sweep.get('name', '?')} (target {run.sweep.get('target', '?')})"),
             ("description", description_line(run.sweep, run.records)),
             ("device", m.get("device") or ""), ("GPU", gpu or "none"), ("driver", env.get("driver") or ""),
             ("CUDA", env.get("cuda") or ""), ("torch", env.get("torch") or ""), ("Triton", env.get("triton") or ""),
             ("DeepEP", env.get("deep_ep") or "not installed"), ("commit", m.get("git_commit") or "unknown"),
             ("created (UTC)", m.get("created_utc") or ""), ("command", m.get("command") or ""),
             ("points", str(len(run.records)))]
    return [(k, str(v)) for k, v in items if v != ""]


def summary_line(run: RunView) -> str:
    """One line under the run's title: sweep, target, machine, commit, when, and the points by status."""
    env = run.manifest.get("env") or {}
    machine = (f"{env['gpu']} x{env.get('gpu_count', 1)}" if env.get("gpu")
               else f"CPU ({env['cpu']})" if env.get("cpu") else run.manifest.get("device") or "unknown machine")
    when = str(run.manifest.get("created_utc") or "")[:16].replace("T", " ")
    parts = [f"sweep {run.sweep.get('name', '?')} (target {run.sweep.get('target', '?')}) on {machine}",
             f"commit {str(run.manifest.get('git_commit') or 'unknown')[:12]}"] + ([f"{when} UTC"] if when else [])
    return ", ".join(parts) + f"; points: {status_counts(run)}"


def status_counts(run: RunView) -> str:
    counts: dict[str, int] = {}
    for r in run.records:
        counts[r.get("status", "?")] = counts.get(r.get("status", "?"), 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


def _axis_names(run: RunView) -> list[str]:
    axes = list((run.sweep.get("axes") or {}).keys())
    if axes:
        return axes
    varying = []
    for k in (run.records[0].get("params") or {} if run.records else {}):
        if len({json.dumps((r.get("params") or {}).get(k)) for r in run.records}) > 1:
            varying.append(k)
    return varying


def _num(v: Any) -> str:
    return cells.plain(v)


def table(run: RunView) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the run's points: the columns of the table `moebench run` prints (same names, same number
    formats: moebench.report.table.METRICS), the fraction of the GEMM ceiling and the reason."""
    axes = _axis_names(run)
    fraction = {row["point"]: row["fraction_of_ceiling"] for row in ceiling_rows(run.records)}
    head = ["point", "impl", *axes, *(metric_title(m) for m in METRICS), "of ceiling", "reason"]
    rows = []
    for r in run.records:
        params = r.get("params") or {}
        reason = str(r.get("reason") or "")
        rows.append([_num(r.get("point")), str(r.get("impl", "")), *(param_cell(params.get(k)) for k in axes),
                     *(m.text(m.value(r)) for m in METRICS), cells.ratio(fraction.get(r.get("point"))),
                     reason if len(reason) <= MAX_REASON else reason[:MAX_REASON - 3] + "..."])
    for title in ("reason", "of ceiling"):  # the columns stdout has not, only where some point fills them
        col = head.index(title)
        if all(row[col] in ("", cells.MISSING) for row in rows):
            head.pop(col)
            for row in rows:
                row.pop(col)
    return head, rows


def ceiling_table(run: RunView) -> tuple[list[str], list[list[str]]]:
    """(header, rows): each record beside the GEMM ceiling timed at its point (moebench.report.ceiling)."""
    head = ["point", "impl", "expert dtype", "p50 (us)", "ceiling (us)", "of ceiling", "experts stage of ceiling",
            "equal-group ceiling (us)", "uneven cost"]
    rows = [[_num(r["point"]), str(r["impl"]), str(r["expert_dtype"]), cells.us(r["p50"]), cells.us(r["ceiling_us"]),
             cells.ratio(r["fraction_of_ceiling"]), cells.ratio(r["experts_stage_fraction"]),
             cells.us(r["ceiling_equal_us"]), cells.ratio(r["uneven_cost"])] for r in ceiling_rows(run.records)]
    return head, rows


def notes(run: RunView) -> list[str]:
    """The caveats `moebench run` prints under its table (moebench.report.table.status_lines: points by status,
    failures, reasons for skipping; column_notes: why a column says n/a; a serving trace's footer: how its times
    were had, the models' errors, the cards, what each phase cost; a capture search's table and headlines, as
    `moebench capture-search` prints them); its GEMM-ceiling and best-peer blocks are the page's own tables."""
    return (status_lines(run.records) + column_notes(run.records) + trace_tax.footer_lines(run.records)
            + capture_search_report.footer_lines(run.records))


def peer_table(run: RunView) -> tuple[list[str], list[list[str]]]:
    """(header, rows): each impl against the fastest other peer at its point (moebench.report.peers)."""
    rows = peer_ratios(run.records)
    keys = _varying_params([r["params"] for r in rows])
    head = ["point", "impl", *keys, "p50 (us)", "best peer", "peer p50 (us)", "ratio"]
    return head, [[_num(r["point"]), str(r["impl"]), *(param_cell(r["params"].get(k)) for k in keys),
                   cells.us(r["p50"]), str(r["best_peer"]), cells.us(r["best_peer_p50"]), ratio_text(r)]
                  for r in rows]


def peer_caption(run: RunView) -> str:
    """The peer table's caption, with the caveat where some rows were timed in different modes."""
    mixed = not all(r["comparable"] for r in peer_ratios(run.records))
    return PEER_CAPTION + (f" ({MODES_DIFFER}.)" if mixed else "")


def _varying_params(params: list[dict]) -> list[str]:
    values: dict[str, set[str]] = {}
    for p in params:
        for k, v in p.items():
            values.setdefault(k, set()).add(json.dumps(v, sort_keys=True, default=str))
    return [k for k, vals in values.items() if len(vals) > 1]


def timing(run: RunView) -> tuple[str, bool]:
    """How the run was timed, and whether its figures are GPU ones (moebench.report.table.timing_statement)."""
    return timing_statement(run.records, run.manifest)


def headline_table(run: RunView) -> tuple[list[str], list[list[str]]]:
    head = ["headline", "without", "with", "without / with", "check"]
    rows = []
    for h in run.headlines:
        check = "" if h.equal is None else ("equal: " if h.equal else "NOT equal: ") + h.equal_detail
        rows.append([h.label,
                     f"{h.without_label}: "
                     f"{side_text(h.without, h.why_without, h.note_without, h.unit, h.model_without)}",
                     f"{h.with_label}: {side_text(h.with_, h.why_with, h.note_with, h.unit, h.model_with)}",
                     h.change, check])
    return head, rows


def _us(v: Any) -> str:
    return cells.us(v)


def profile_caption(prof: dict) -> str:
    """One line: which point, how it was profiled, what the device columns mean."""
    what = f"point {prof.get('point', '?')}" + (f" ({prof['impl']})" if prof.get("impl") else "")
    tail = f"; error: {prof['error']}" if prof.get("error") else ""
    return f"{prof.get('_dir', '')}: {what}, {prof.get('header') or prof.get('mode', '')}{tail}"


def profile_table(prof: dict) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of a profile's per-range summary: the point's range, then its stages."""
    head = ["range", "count", "cpu us/call", "device us/call", "device us total", "share", "top kernels"]
    rows = []
    for s in prof.get("summary") or []:
        # a CPU profile has no device time: its ranges' share of the point's wall time
        share = s.get("device_share") if s.get("device_share") is not None else s.get("wall_share")
        kernels = "; ".join(f"{k['name']} x{k['count']} {k['total_us']:.1f} us"
                            for k in (s.get("kernels") or [])[:TOP_KERNELS])
        rows.append([s["range"], _num(s.get("count")), _us(s.get("cpu_mean_us")), _us(s.get("device_mean_us")),
                     _us(s.get("device_total_us")), "-" if share is None else f"{100 * share:.1f}%", kernels])
    return head, rows


# ---------------------------------------------------------------------------------------------------------------
# HTML
# ---------------------------------------------------------------------------------------------------------------

_CSS = """body{font-family:system-ui,sans-serif;margin:1em auto;padding:0 1em;max-width:1400px;color:#222}
.wide{overflow-x:auto}td:last-child{min-width:12em}p.summary{margin:.3em 0}
h1{font-size:1.5em}h2{font-size:1.25em;border-bottom:1px solid #ccc;padding-top:1em}h3{font-size:1.05em}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0}td,th{border:1px solid #ddd;padding:2px 6px;
text-align:left;vertical-align:top}th{background:#f3f3f3}td.n{text-align:right;font-variant-numeric:tabular-nums}
.headlines td{font-size:1.05em}.bad{color:#b00}.plots img{max-width:100%;border:1px solid #eee;margin:4px 0}
dl{display:grid;grid-template-columns:max-content auto;gap:2px 12px;font-size:.9em}dt{font-weight:600}
dd{margin:0;font-family:monospace}p.mode{font-weight:600;border-left:4px solid #2a6;padding:2px 8px}
p.mode.bad{border-color:#b00;background:#fff3f3}pre.notes{font-size:.8em;background:#f7f7f7;padding:6px;
overflow-x:auto}"""


def _html_table(head: list[str], rows: list[list[str]], cls: str = "") -> str:
    e = html.escape
    out = ['<div class="wide">' + (f'<table class="{cls}">' if cls else "<table>"),
           "<tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>"]
    for row in rows:
        tds = []
        for c in row:
            attrs = (' class="n"' if cells.is_number(c) or c == cells.MISSING
                     else ' class="bad"' if c in ("wrong", "failed") else "")
            tds.append(f"<td{attrs}>{e(c)}</td>")
        out.append("<tr>" + "".join(tds) + "</tr>")
    out.append("</table></div>")
    return "\n".join(out)


def profile_only(run: RunView) -> bool:
    """A profile's own folder: no manifest and no records of its own, only the profile (its point's run
    directory has the manifest)."""
    return not run.manifest and not run.records and bool(run.profiles)


def _data_uri(png: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode("ascii")


def render_html(runs: list[RunView], title: str) -> str:
    e = html.escape
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{e(title)}</title>",
             f"<style>{_CSS}</style></head><body>", f"<h1>{e(title)}</h1>"]
    if len(runs) > 1:
        parts.append("<ul>" + "".join(f'<li><a href="#run-{i}">{e(r.name)}</a> ({e(status_counts(r))})</li>'
                                      for i, r in enumerate(runs)) + "</ul>")
    for i, run in enumerate(runs):
        parts.append(f'<h2 id="run-{i}">{e(run.name)}</h2>')
        if run.records:  # the header: how the run was timed, what it is
            text, gpu_figures = timing(run)
            parts.append(f'<p class="{"mode" if gpu_figures else "mode bad"}">{e(text)}</p>')
            parts.append(f'<p class="summary">{e(summary_line(run))}</p>')
        lead_plots = [png for png in run.plots if png.name.split("__")[0].removesuffix(".png") in trace_tax.LEAD_PLOTS]
        for tax_title, tax_head, tax_rows in trace_tax.sections(run.records):  # a serving_trace run: first
            parts.append(f"<h3>{e(tax_title)}</h3>")
            parts.append(_html_table(tax_head, tax_rows, cls="headlines"))
        if lead_plots:  # its EP-step figures beside its tables
            parts.append('<div class="plots">' + "".join(
                f'<figure><img alt="{e(png.name)}" src="{_data_uri(png)}"><figcaption>{e(png.name)}</figcaption>'
                f"</figure>" for png in lead_plots) + "</div>")
        if run.headlines:
            parts.append("<h3>Headline numbers</h3>")
            parts.append(_html_table(*headline_table(run), cls="headlines"))
        if run.records:
            parts.append(f'<h3>Notes</h3><pre class="notes">{e(chr(10).join(notes(run)))}</pre>')
        if run.plots:
            parts.append('<h3>Plots</h3><div class="plots">')
            if run.plot_note:
                parts.append(f"<p>{e(run.plot_note)}</p>")
            for png in run.plots:
                if png in lead_plots:
                    continue
                parts.append(f'<figure><img alt="{e(png.name)}" src="{_data_uri(png)}">'
                             f"<figcaption>{e(png.name)}</figcaption></figure>")
            parts.append("</div>")
        elif not profile_only(run):
            parts.append(f"<p>{e(run.plot_note or 'No plots found for this run.')}</p>")
        if run.records:
            parts.append("<h3>Points</h3>")
            if timed_call_line(run.sweep.get("target")):
                parts.append(f"<p>{e(timed_call_line(run.sweep.get('target')))}</p>")
            parts.append(_html_table(*table(run)))
        if peer_ratios(run.records):
            parts.append(f"<h3>Against the best peer</h3><p>{e(peer_caption(run))}</p>")
            parts.append(_html_table(*peer_table(run)))
        if ceiling_rows(run.records):
            parts.append(f"<h3>The GEMM ceiling</h3><p>{html.escape(CEILING_CAPTION)}</p>")
            parts.append(_html_table(*ceiling_table(run)))
        for prof in run.profiles:
            parts.append("<h3>Profile: where the device time goes</h3>")
            parts.append(f"<p>{e(profile_caption(prof))}</p>")
            parts.append(_html_table(*profile_table(prof), cls="profile"))
        if not profile_only(run):
            parts.append("<h3>Run</h3><dl>" + "".join(f"<dt>{e(k)}</dt><dd>{e(v)}</dd>"
                                                      for k, v in manifest_items(run)) + "</dl>")
            parts.append(f"<p>points: {e(status_counts(run))}</p>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------------------------

def _md_cell(c: str) -> str:
    return c.replace("|", "\\|").replace("\n", " ")


def _md_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(_md_cell(h) for h in head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def render_markdown(runs: list[RunView], title: str, out_dir: Path) -> str:
    parts = [f"# {title}", ""]
    for run in runs:
        parts += [f"## {run.name}", ""]
        if run.records:  # the header: how the run was timed, what it is
            parts += [f"**{timing(run)[0]}**", "", summary_line(run), ""]
        for tax_title, tax_head, tax_rows in trace_tax.sections(run.records):  # a serving_trace run: first
            parts += [f"### {tax_title}", "", _md_table(tax_head, tax_rows), ""]
        if run.headlines:
            parts += ["### Headline numbers", "", _md_table(*headline_table(run)), ""]
        if run.records:
            parts += ["### Notes", "", "```", *notes(run), "```", ""]
        if run.plots:
            parts += ["### Plots", ""] + ([run.plot_note, ""] if run.plot_note else [])
            for png in run.plots:
                rel = Path(os.path.relpath(png.resolve(), out_dir.resolve())).as_posix()
                parts.append(f"![{png.stem}]({rel})")
            parts.append("")
        elif not profile_only(run):
            parts += [run.plot_note or "No plots found for this run.", ""]
        if run.records:
            timed = timed_call_line(run.sweep.get("target"))
            parts += ["### Points", "", *([timed, ""] if timed else []), _md_table(*table(run)), ""]
        if peer_ratios(run.records):
            parts += ["### Against the best peer", "", peer_caption(run), "", _md_table(*peer_table(run)), ""]
        if ceiling_rows(run.records):
            parts += ["### The GEMM ceiling", "", CEILING_CAPTION, "", _md_table(*ceiling_table(run)), ""]
        for prof in run.profiles:
            parts += ["### Profile: where the device time goes", "", profile_caption(prof), "",
                      _md_table(*profile_table(prof)), ""]
        if not profile_only(run):
            parts += ["### Run", ""] + [f"- **{k}**: `{v}`" if k in ("commit", "command") else f"- **{k}**: {v}"
                                        for k, v in manifest_items(run)]
            parts += [f"- **status**: {status_counts(run)}", ""]
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------------------------

def write_report(run_dirs: list[str | Path], out: str | Path, title: str = "moebench report") -> Path:
    """Load every run (all must be valid), render by the output's suffix, write atomically; returns the path."""
    out = Path(out)
    if out.suffix.lower() not in FORMATS:
        raise ReportError(f"-o {out}: the output must end in .html or .md")
    if not run_dirs:
        raise ReportError("report: give at least one run directory")
    if not out.parent.is_dir():
        raise ReportError(f"-o {out}: no such directory {out.parent}")
    if out.is_dir():
        raise ReportError(f"-o {out}: is a directory")
    runs = [load_run(d) for d in run_dirs]
    html_page = out.suffix.lower() == ".html"
    with tempfile.TemporaryDirectory(prefix="moebench-report-") as tmp_plots:
        scratch = Path(tmp_plots) if html_page else scratch_dir_for(out)  # Markdown links its figures
        for run in runs:
            if run.records and not run.plots:
                run.plots, run.plot_note = draw_plots(run.path, scratch)
        text = render_html(runs, title) if html_page else render_markdown(runs, title, out.parent)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, out)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise ReportError(f"-o {out}: cannot write ({e.strerror})") from None
    return out
