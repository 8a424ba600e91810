"""The chart of a ``make bench`` (or ``make bench-peers``) run: tok/s, TPOT and the roofline per system, as a PNG.

    python -m benchmarks.chart --results bench-results.json --out docs/bench.png      (make bench)
    python -m benchmarks.chart --results bench-peers.json --out docs/bench-peers.png  (make bench-peers)

Reads the JSON :mod:`benchmarks.bench` writes (``--out``; or :mod:`benchmarks.bench_peers`'s: one
group of bars, :func:`chart_groups`): its ``results`` (per dtype, per system
key -- "hf", "tp1", "tp2", "tp1-int8", ... -- the best round's ``output_tok_s`` and ``tpot_ms``; a
latency-only row has no ``output_tok_s``), ``config`` (the model and the workload) and ``machine``
(the CPU model, its flags, cores, torch). The JSON holds no date, so the title's date is the
results file's modification time unless ``--date`` is given. Drawn with matplotlib's Agg backend
(no display needed): one panel of grouped bars for output tok/s and, where any row has one, one
for TPOT ms, one for TPOT / the weight-bandwidth floor (a line at 1) and one for the throughput's
fraction of the GEMM ceiling (:mod:`benchmarks.roofline`), two panels a row; one group per dtype,
one bar per system, the CPU model, the date and the measured roofline in the title.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(add_completion=False)

#: Bar colours per system key; other keys (another tp, another scheme) take the cycle's next colour.
COLORS = {"hf": "#7f7f7f", "tp1": "#1f77b4", "tp2": "#ff7f0e", "tp1-int8": "#2ca02c", "tp2-int8": "#98df8a",
          "tp1-int4": "#9467bd", "tp2-int4": "#c5b0d5"}

#: The panels: (result key, y-axis label, value format); a panel is drawn when any row has its key.
PANELS = (("output_tok_s", "output tok/s (higher is better)", "{:.0f}"),
          ("tpot_ms", "TPOT ms, batch 1 (lower is better)", "{:.1f}"),
          ("tpot_vs_floor", "TPOT / weight-bandwidth floor (1 = at the floor)", "{:.2f}x"),
          ("flops_fraction", "throughput FLOPs / GEMM ceiling", "{:.1%}"))
#: The panels drawn with a line at 1 (the limit itself).
AT_LIMIT = ("tpot_vs_floor",)


def system_label(system: str) -> str:
    """The name :mod:`benchmarks.bench_report` shows for a system key: "hf" -> "HF generate",
    "tp2" -> "tpengine tp=2", "tp1-int8" -> "tpengine tp=1 int8"."""
    if system == "hf":
        return "HF generate"
    tp, _, quant = system.removeprefix("tp").partition("-")
    return f"tpengine tp={tp}" + (f" {quant}" if quant else "")


def system_order(results: dict) -> list[str]:
    """Every system key of ``results`` (``{dtype: {system: row}}``) once: HF first, then tpengine
    with float weights by tp, then the quantized rows by scheme (in first-seen order) and tp."""
    seen: list[str] = []
    for rows in results.values():
        seen += [s for s in rows if s not in seen]
    schemes = list(dict.fromkeys(s.partition("-")[2] for s in seen if "-" in s))

    def key(s: str) -> tuple:
        if s == "hf":
            return (0, 0, 0)
        tp, _, quant = s.removeprefix("tp").partition("-")
        return (1 if not quant else 2, schemes.index(quant) if quant else 0, int(tp) if tp.isdigit() else 0)

    return sorted(seen, key=key)


def run_date(result_path: Path, date: str | None = None) -> str:
    """``date`` if given, else ``result_path``'s modification time as ``YYYY-MM-DD HH:MM`` (local
    time): the JSON of :mod:`benchmarks.bench` holds no date of its own."""
    if date:
        return date
    return datetime.fromtimestamp(result_path.stat().st_mtime).strftime("%Y-%m-%d %H:%M")


def chart_title(result: dict, date: str) -> str:
    """Two lines: ``make bench, <CPU model> (<flags>), <cores> cores, <date>`` (``make bench-peers``
    for its JSON) and the model with its workloads and torch version, from ``result`` (the JSON
    :mod:`benchmarks.bench` or :mod:`benchmarks.bench_peers` writes); a third, the measured roofline
    (:func:`benchmarks.roofline.roofline_text`), where the run has one."""
    m, c = result.get("machine", {}), result.get("config", {})
    flags = m.get("cpu_flags")
    flag_text = " (" + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in flags.items()) + ")" if flags else ""
    cores = f", {m['cores']} cores" if "cores" in m else ""
    target = "make bench-peers" if "systems" in result else "make bench"
    line1 = f"{target}, {m.get('cpu', 'unknown CPU')}{flag_text}{cores}, {date}"
    parts = []
    if "model" in c:
        parts.append(Path(str(c["model"])).name)
    if {"num_prompts", "input_len", "output_len"} <= set(c):
        parts.append(f"throughput {c['num_prompts']} x ({c['input_len']} -> {c['output_len']})")
    if {"latency_input_len", "latency_output_len"} <= set(c):
        parts.append(f"latency 1 x ({c['latency_input_len']} -> {c['latency_output_len']})")
    if "torch" in m:
        parts.append(f"torch {m['torch']}")
    if "rounds" in c:
        parts.append(f"best of {c['rounds']} round(s)")
    text = line1 + ("\n" + "; ".join(parts) if parts else "")
    if result.get("roofline"):
        from benchmarks.roofline import roofline_text

        text += "\n" + roofline_text(result["roofline"])
    return text


def chart_panels(results: dict) -> list[tuple[str, str, str]]:
    """The :data:`PANELS` that some row of ``results`` (``{dtype: {system: row}}``) has a value for."""
    return [p for p in PANELS if any(p[0] in row for rows in results.values() for row in rows.values())]


#: The one group of a ``make bench-peers`` chart (every system one process with all cores).
PEERS_GROUP = "one process, all cores"


def chart_groups(result: dict) -> tuple[dict, list[str], dict[str, str]]:
    """``(groups, systems, labels)`` of a results JSON: :mod:`benchmarks.bench`'s, its dtypes as the
    groups (``{dtype: {system: row}}``), :func:`system_order` and :func:`system_label`; or
    :mod:`benchmarks.bench_peers`'s (it has ``systems``): one group, :data:`PEERS_GROUP`, its rows in
    its table's order, each labelled with its name and precision."""
    results = result.get("results") or {}
    if "systems" in result:
        meta = result["systems"]
        return ({PEERS_GROUP: results} if results else {}), list(results), {
            k: f"{meta[k]['name']} {meta[k]['precision']}" for k in results}
    systems = system_order(results)
    return results, systems, {s: system_label(s) for s in systems}


def draw_chart(result: dict, out: Path, date: str) -> Path:
    """Draw ``result`` (the JSON :mod:`benchmarks.bench` or :mod:`benchmarks.bench_peers` writes) as a
    PNG at ``out`` (its folder made if missing) and return ``out``: per panel of :data:`PANELS` that
    any row has, one group of bars per :func:`chart_groups` group (bench: per dtype) and one bar per
    system that has the value, each bar labelled with it; a legend of the systems and
    :func:`chart_title` over the figure.

    Raises:
        ValueError: ``result`` has no ``results`` rows with any panel's value.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter

    results, systems, labels = chart_groups(result)
    dtypes = list(results)
    panels = chart_panels(results)
    if not panels:
        raise ValueError(f"no results to chart: no row has {', '.join(p[0] for p in PANELS)}")
    cycle = iter(plt.rcParams["axes.prop_cycle"].by_key().get("color", ["#333333"]) * 4)
    colors = {s: COLORS.get(s) or next(cycle) for s in systems}
    panel_width = max(5.0, 0.45 * len(systems) * len(dtypes) + 1.5)
    ncols = min(2, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, grid = plt.subplots(nrows, ncols, figsize=(panel_width * ncols, 4.5 * nrows + 0.5), squeeze=False)
    axes = [ax for row in grid for ax in row]
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    for ax, (key, label, fmt) in zip(axes, panels):
        # per dtype, the systems that have this value, side by side around the dtype's tick
        present = [[s for s in systems if results[dt].get(s, {}).get(key) is not None] for dt in dtypes]
        width = 0.8 / max(1, max(map(len, present)))
        points: dict[str, tuple[list[float], list[float]]] = {}
        for i, (dt, group) in enumerate(zip(dtypes, present)):
            for k, s in enumerate(group):
                xs, ys = points.setdefault(s, ([], []))
                xs.append(i + width * (k + 0.5 - len(group) / 2))
                ys.append(results[dt][s][key])
        for s in systems:
            if s in points:
                xs, ys = points[s]
                bars = ax.bar(xs, ys, width, label=labels[s], color=colors[s])
                ax.bar_label(bars, labels=[fmt.format(v) for v in ys], fontsize=7, padding=2)
        if key in AT_LIMIT:
            ax.axhline(1.0, color="#333333", linewidth=0.8, linestyle="--")
        if fmt.endswith("%}"):  # a fraction: its axis in per cent too
            ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax.set_xticks(range(len(dtypes)), dtypes)
        ax.set_ylabel(label, fontsize=8)
        ax.margins(y=0.12)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    handles: dict = {}  # label -> bar handle, each system once over the panels
    for ax in axes[:len(panels)]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(len(handles), 4), fontsize=8,
               frameon=False)
    fig.suptitle(chart_title(result, date), fontsize=9)
    fig.tight_layout(rect=(0, 0.1 / nrows, 1, 1 - 0.1 / nrows))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=120)
    plt.close(fig)
    return out


@app.command()
def main(
    results: Annotated[Path, typer.Option(help="the JSON of python -m benchmarks.bench (or bench_peers) --out")] = Path(
        "bench-results.json"),
    out: Annotated[Path, typer.Option(help="the PNG to write")] = Path("docs/bench.png"),
    date: Annotated[str | None, typer.Option(help="the date in the title (default: the results file's "
                                                   "modification time)")] = None,
) -> None:
    """Draw the chart of a make bench or bench-peers run (tok/s, TPOT, the roofline per system) as a PNG."""
    try:
        result = json.loads(results.read_text())
    except (OSError, ValueError) as e:
        raise typer.BadParameter(f"--results {results}: cannot read it as JSON ({e})") from None
    try:
        draw_chart(result, out, run_date(results, date))
    except ValueError as e:
        raise typer.BadParameter(f"--results {results}: {e}") from None
    typer.echo(f"wrote {out}")


if __name__ == "__main__":
    app()
