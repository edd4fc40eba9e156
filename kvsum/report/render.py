"""One document, two renderings: a self-contained HTML page (plots as base64 PNG) and a markdown twin.

A document is a list of blocks: ("h2", text), ("p", text), ("list", [text]), ("table", header, rows),
("plot", name, figure). Text may use `code` and **bold**. The markdown twin links the same plots as PNG
files under plots/. The page records how many plots it holds and, once loaded, how many decoded and any
script errors, in attributes on <body> (what benchmarks/check_report.py reads from a real browser).
"""

from __future__ import annotations

import base64
import html
import io
import re
from pathlib import Path

from ..extras import require_eval

require_eval("kvsum.report", ("matplotlib",), error=ImportError)  # one line naming the extra, not a traceback

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:13px}th,td{border:1px solid #ccc;padding:3px 7px;text-align:left}
th{background:#f3f3f3}td.n{text-align:right}img{max-width:100%;display:block;margin:1em 0}
code{background:#f3f3f3;padding:0 3px}h2{border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:2em}"""

SCRIPT = """window.addEventListener('error',function(e){var b=document.body;
b.dataset.errors=(b.dataset.errors||'')+(e.message||'resource error')+';'},true);
window.addEventListener('load',function(){var ok=0,imgs=document.querySelectorAll('img[data-plot]');
imgs.forEach(function(i){if(i.complete&&i.naturalWidth>0)ok++});document.body.dataset.plotsDecoded=ok;
document.body.dataset.loaded='yes'});"""


def _inline_html(text: str) -> str:
    out = html.escape(text)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    return re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", out)


def _td(cell) -> str:
    text = str(cell)
    num = re.fullmatch(r"[-+]?[\d.,]+(e[-+]?\d+)?( @ \d+)?|[\d]+/[\d]+|-", text) is not None
    return f'<td class="n">{_inline_html(text)}</td>' if num else f"<td>{_inline_html(text)}</td>"


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def render(blocks: list[tuple], out_dir: Path, title: str) -> tuple[Path, Path]:
    """Write out_dir/report.html and out_dir/report.md (+ out_dir/plots/*.png); returns both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "plots").mkdir(exist_ok=True)
    md, body, plots = [f"# {title}", ""], [f"<h1>{html.escape(title)}</h1>"], 0
    for b in blocks:
        kind = b[0]
        if kind == "h2":
            md += [f"## {b[1]}", ""]
            body.append(f"<h2>{_inline_html(b[1])}</h2>")
        elif kind == "p":
            md += [b[1], ""]
            body.append(f"<p>{_inline_html(b[1])}</p>")
        elif kind == "list":
            md += [f"- {x}" for x in b[1]] + [""]
            body.append("<ul>" + "".join(f"<li>{_inline_html(x)}</li>" for x in b[1]) + "</ul>")
        elif kind == "table":
            header, rows = b[1], b[2]
            md += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            md += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows] + [""]
            body.append("<table><tr>" + "".join(f"<th>{_inline_html(h)}</th>" for h in header) + "</tr>"
                        + "".join("<tr>" + "".join(_td(c) for c in r) + "</tr>" for r in rows) + "</table>")
        elif kind == "plot":
            name, fig = b[1], b[2]
            data = _png(fig)
            (out_dir / "plots" / f"{name}.png").write_bytes(data)
            md += [f"![{name}](plots/{name}.png)", ""]
            body.append(f'<img data-plot="{html.escape(name)}" alt="{html.escape(name)}" '
                        f'src="data:image/png;base64,{base64.b64encode(data).decode()}">')
            plots += 1
    page = (f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>{html.escape(title)}</title>"
            f'<meta name="kvsum-plots" content="{plots}"><style>{CSS}</style><script>{SCRIPT}</script></head>'
            f'<body data-plots="{plots}">' + "\n".join(body) + "</body></html>\n")
    h, m = out_dir / "report.html", out_dir / "report.md"
    h.write_text(page)
    m.write_text("\n".join(md) + "\n")
    return h, m


# --- plots --------------------------------------------------------------------------------------------------

MARKERS = "os^vD<>pP*hX"


def _style(i: int) -> dict:
    return dict(color=plt.get_cmap("tab20")(i % 20), marker=MARKERS[i % len(MARKERS)])


def pareto(rows: list[dict], task: str, methods: list[str]):
    """Bytes held (fraction of the fp16 full cache) against accuracy or KL, one line per method."""
    sub = [r for r in rows if r["task"] == task]
    lm = bool(sub) and "kl" in sub[0]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for i, m in enumerate(methods):
        pts = sorted((r["ratio"], r["kl"] if lm else r["score"]) for r in sub if r["method"] == m and m != "full")
        if pts:
            ax.plot([p[0] for p in pts], [max(p[1], 1e-6) if lm else p[1] for p in pts], label=m, lw=1.3, ms=5,
                    **_style(i))
    full = [r for r in sub if r["method"] == "full"]
    if lm:
        ax.set_yscale("log")
        ax.set_ylabel("KL(full || compressed), nats (log)")
        if full:  # KL 0 has no place on a log axis: the full cache is marked by its bytes instead
            ax.axvline(full[0]["ratio"], color="k", ls="--", lw=1,
                       label=f"full cache (KL 0, {full[0]['ratio']:.2f} of fp16 bytes)")
    else:
        ax.set_ylabel("accuracy %")
        if full:
            ax.axhline(full[0]["score"], color="k", ls="--", lw=1, label=f"full cache ({full[0]['score']:.0f}%)")
        ax.set_ylim(-5, 105)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes held / full fp16 cache (log2)")
    ax.set_title(f"{task}: quality against bytes held")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return fig


def throughput_bars(rows: list[dict]):
    lengths = sorted({r["length"] for r in rows})
    methods = sorted({r["method"] for r in rows}, key=lambda m: -min(r["ratio_to_full"] for r in rows
                                                                      if r["method"] == m))
    fig, ax = plt.subplots(figsize=(9, 4.2))
    w = 0.8 / max(len(lengths), 1)
    for j, length in enumerate(lengths):
        vals = [next((r["ratio_to_full"] for r in rows if r["method"] == m and r["length"] == length), 0)
                for m in methods]
        ax.bar([i + j * w for i in range(len(methods))], vals, w, label=f"{length}-token prompt")
    ax.axhline(1.0, color="k", ls="--", lw=1, label="full cache")
    ax.set_xticks([i + w * (len(lengths) - 1) / 2 for i in range(len(methods))], methods, rotation=45, ha="right",
                  fontsize=8)
    new = rows[0]["new"] if rows else 0
    ax.set_ylabel("throughput / full cache")
    ax.set_title(f"short-context throughput (prefill + compress + {new} tokens), method always on")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return fig


def scaling_plot(rows: list[dict], key: str, ylabel: str, title: str, full_key: str | None = None):
    rows = [r for r in rows if r.get(key) is not None]
    methods = sorted({r["method"] for r in rows})
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, m in enumerate(methods):
        pts = sorted((r["length"], r[key]) for r in rows if r["method"] == m)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=m, lw=1.3, ms=5, **_style(i))
    if full_key:
        pts = sorted({(r["length"], r[full_key]) for r in rows if r.get(full_key) is not None})
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "k--", lw=2, label="full cache")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return fig


def stability_layers(summary: dict):
    fig, ax = plt.subplots(figsize=(8, 4))
    for dt, v in summary.items():
        if v.get("floor"):
            hr = v["floor"]["hidden_rel"]
            ax.plot(range(len(hr)), [max(x, 1e-12) for x in hr], marker="o", ms=3, label=dt)
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("relative error of the hidden state")
    ax.set_title("cache on vs cache off: per-layer drift of the last position (decode steps)")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def stability_methods(summary: dict):
    dts = [dt for dt in summary if summary[dt]["methods"]]
    methods = sorted({m for dt in dts for m in summary[dt]["methods"]},
                     key=lambda m: summary[dts[0]]["methods"].get(m, {}).get("kl", 0) if dts else 0)
    fig, ax = plt.subplots(figsize=(9, 4.2))
    w = 0.8 / max(len(dts), 1)
    for j, dt in enumerate(dts):
        vals = [max(summary[dt]["methods"][m]["kl"], 1e-12) if m in summary[dt]["methods"] else float("nan")
                for m in methods]  # a method not run in this precision: no bar
        ax.bar([i + j * w for i in range(len(methods))], vals, w, label=f"{dt}: method vs full")
        fl = summary[dt].get("floor")
        if fl:
            ax.axhline(max(fl["kl"], 1e-12), ls="--", lw=1, color=f"C{j}", label=f"{dt}: cache on vs off")
    ax.set_xticks([i + w * (len(dts) - 1) / 2 for i in range(len(methods))], methods, rotation=45, ha="right",
                  fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("KL, nats (log)")
    ax.set_title("what compression adds over the precision floor")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.grid(axis="y", alpha=0.3)
    return fig
