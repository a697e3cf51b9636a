"""PNG plots of bench results (matplotlib, imported lazily: `pip install 'kvflash[bench]'`)."""
from __future__ import annotations

from pathlib import Path

from .common import ctx_label, is_stat


class PlotUnavailable(RuntimeError):
    pass


def _plt():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install matplotlib (or pip install 'kvflash[bench]')") \
            from None
    return plt


def _series(rows, key, group):
    out: dict = {}
    for r in rows:
        v = r.get(key)
        if not is_stat(v) or v["median"] is None:
            continue
        out.setdefault(group(r), []).append((r["context"], v))
    return {k: sorted(v, key=lambda t: t[0]) for k, v in out.items()}


def _label(r) -> str:
    return "full cache" if r.get("mode") == "full" else f"kvflash pool {r.get('pool')} ({r.get('policy')})"


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_all(results: list, folder: Path, title_suffix: str = "") -> list:
    """Write whatever plots the results allow; returns the files written."""
    # Long on purpose: one figure per result kind, drawn in sequence with the same axes setup.
    plt = _plt()
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    by = {r.routine: r for r in results}

    # decode tok/s vs context (from `decode`, else from `ab`)
    src = by.get("decode") or by.get("ab")
    if src is not None:
        ser = _series(src.rows, "decode_tok_s", _label)
        if ser:
            fig, ax = plt.subplots(figsize=(7, 4.5))
            for name, pts in ser.items():
                xs = [p[0] for p in pts]
                med = [p[1]["median"] for p in pts]
                lo = [p[1]["median"] - p[1]["min"] for p in pts]
                hi = [p[1]["max"] - p[1]["median"] for p in pts]
                ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, label=name)
            ax.set_xscale("log", base=2)
            xs_all = sorted({p[0] for pts in ser.values() for p in pts})
            ax.set_xticks(xs_all, [ctx_label(x) for x in xs_all])
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel("decode tok/s (median, min-max bars)")
            ax.set_ylim(bottom=0)
            ax.set_title("Decode speed vs context" + title_suffix)
            ax.grid(alpha=0.3)
            ax.legend()
            written.append(_save(plt, fig, folder / "decode_vs_context.png"))

    # resident KV vs context (from `memory`, else decode/ab rows)
    src = by.get("memory") or by.get("ab")
    if src is not None:
        groups: dict = {}
        for r in src.rows:
            if isinstance(r.get("kv_resident_mib"), (int, float)):
                name = "full cache" if r.get("mode") == "full" else f"{r.get('mode')} pool {r.get('pool')}"
                groups.setdefault(name, []).append((r["context"], r["kv_resident_mib"], r.get("host_mib") or 0.0))
        if groups:
            fig, ax = plt.subplots(figsize=(7, 4.5))
            for name, pts in groups.items():
                pts.sort()
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{name}: resident")
                if any(p[2] for p in pts):
                    ax.plot([p[0] for p in pts], [p[2] for p in pts], marker="x", linestyle="--",
                            label=f"{name}: host")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            xs_all = sorted({p[0] for pts in groups.values() for p in pts})
            ax.set_xticks(xs_all, [ctx_label(x) for x in xs_all])
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel("KV MiB")
            ax.set_title("Resident KV vs context" + title_suffix)
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=8)
            written.append(_save(plt, fig, folder / "kv_resident_vs_context.png"))

    # needle heat map: depth x context, one panel per mode
    src = by.get("needle") or by.get("ab")
    if src is not None and src.raw and "depth" in src.raw[0]:
        import numpy as np
        keys = []
        for x in src.raw:
            k = "full" if x["mode"] == "full" else f"{x['policy']} pool {x['pool']}"
            if k not in keys:
                keys.append(k)
        ctxs = sorted({x["context"] for x in src.raw})
        depths = sorted({x["depth"] for x in src.raw})
        fig, axes = plt.subplots(1, len(keys), figsize=(2.2 + 2.0 * len(keys) * max(1, len(ctxs)) / 2, 3.2),
                                 squeeze=False)
        for ax, k in zip(axes[0], keys):
            grid = np.full((len(depths), len(ctxs)), np.nan)
            txt = [["" for _ in ctxs] for _ in depths]
            for i, d in enumerate(depths):
                for j, c in enumerate(ctxs):
                    xs = [x for x in src.raw if x["context"] == c and x["depth"] == d and
                          ("full" if x["mode"] == "full" else f"{x['policy']} pool {x['pool']}") == k]
                    if xs:
                        ok = sum(bool(x["correct"]) for x in xs)
                        grid[i, j] = ok / len(xs)
                        txt[i][j] = f"{ok}/{len(xs)}"
            ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            for i in range(len(depths)):
                for j in range(len(ctxs)):
                    ax.text(j, i, txt[i][j], ha="center", va="center", fontsize=8)
            ax.set_xticks(range(len(ctxs)), [ctx_label(c) for c in ctxs])
            ax.set_yticks(range(len(depths)), [f"{d}%" for d in depths])
            ax.set_title(k, fontsize=9)
            ax.set_xlabel("context")
        axes[0][0].set_ylabel("needle depth")
        fig.suptitle("Needle recall" + title_suffix, fontsize=10)
        written.append(_save(plt, fig, folder / "needle_heatmap.png"))

    # ruler heat map: (task, policy) x (context, residency), coloured by the share of the full cache's score
    src = by.get("ruler")
    if src is not None and src.rows:
        written.append(_ruler_heatmap(plt, src.rows, folder / "ruler_heatmap.png", title_suffix))
    return written


def _ruler_heatmap(plt, rows: list, path: Path, title_suffix: str) -> Path:
    import numpy as np
    ys, xs = [], []
    for r in rows:
        if r["policy"] == "full":
            continue
        y, x = (r["task"], r["policy"]), (r["context"], r["residency"])
        if y not in ys:
            ys.append(y)
        if x not in xs:
            xs.append(x)
    xs.sort(key=lambda x: (x[0], int(x[1].split("/")[1])))
    grid = np.full((len(ys), len(xs)), np.nan)
    txt = [["" for _ in xs] for _ in ys]
    for r in rows:
        if r["policy"] == "full":
            continue
        i, j = ys.index((r["task"], r["policy"])), xs.index((r["context"], r["residency"]))
        grid[i, j] = min(1.0, r["score"] / r["full"]) if r["full"] else np.nan
        txt[i][j] = f"{r['score']:.0f}/{r['full']:.0f}"
    fig, ax = plt.subplots(figsize=(2.5 + 0.9 * len(xs), 1.2 + 0.32 * len(ys)))
    ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    for i in range(len(ys)):
        for j in range(len(xs)):
            ax.text(j, i, txt[i][j], ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(xs)), [f"{ctx_label(c)} {res}" for c, res in xs], fontsize=8)
    ax.set_yticks(range(len(ys)), [f"{t} {p}" for t, p in ys], fontsize=8)
    ax.set_xlabel("context, residency (pool / context)")
    ax.set_title("RULER-style score % / full cache's %\n(colour: share of full)" + title_suffix.replace(" (", "\n("),
                 fontsize=8)
    return _save(plt, fig, path)
