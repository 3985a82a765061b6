"""``rlplane bench --plot``: one PNG of GB/s per path and of the sweeps (matplotlib, Agg).

Example::

    write_plot(results, Path("docs/bench.png"))
"""

from __future__ import annotations

from pathlib import Path

from rlplane_tools.bench.report import sweep_paths


def write_plot(results: dict, path: Path) -> None:
    """Bars of put/get GB/s per path for each workload; lines for the batch and writers sweeps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = results["workloads"]
    sweeps = results.get("sweeps", {})
    panels = len(workloads) + bool(sweeps.get("batch")) + bool(sweeps.get("writers"))
    fig, axes = plt.subplots(1, max(panels, 1), figsize=(6 * max(panels, 1), 4.5), squeeze=False)
    axes = list(axes[0])
    for ax, w in zip(axes, workloads):
        labels = [r["label"] for r in w["paths"]] + ["memcpy"]
        put = [r["ops"]["put"]["gb_per_s"] for r in w["paths"]] + [w["bounds"][0]["gb_per_s"]]
        get = [r["ops"]["get"]["gb_per_s"] for r in w["paths"]] + [w["bounds"][0]["gb_per_s"]]
        x = range(len(labels))
        ax.bar([i - 0.2 for i in x], put, 0.4, label="put")
        ax.bar([i + 0.2 for i in x], get, 0.4, label="get")
        ax.set_xticks(list(x), labels, rotation=30, ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("GB/s (stored bytes, log)")
        ax.set_title(f"{w['workload']} B={w['batch']} ({w['bytes_stored'] / 1e6:.0f} MB)")
        ax.legend(fontsize=8)
    rest = axes[len(workloads):]
    if sweeps.get("batch"):
        ax = rest.pop(0)
        batches = [s["batch"] for s in sweeps["batch"]]
        for name, label in sweep_paths(sweeps["batch"]):
            rows = [next((r for r in s["paths"] if r["path"] == name), None) for s in sweeps["batch"]]
            ax.plot(batches, [float("nan") if r is None else r["ops"]["round trip"]["gb_per_s"] for r in rows], "o-",
                    label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch (samples)")
        ax.set_ylabel("round trip GB/s")
        ax.set_title(f"{sweeps['batch'][0]['workload']} batch sweep")
        ax.legend(fontsize=7)
    if sweeps.get("writers"):
        ax = rest.pop(0)
        ws = sweeps["writers"]
        ax.bar([str(w["writers"]) for w in ws], [w["put"]["gb_per_s"] for w in ws])
        ax.set_xlabel("concurrent writers")
        ax.set_ylabel("aggregate put GB/s")
        ax.set_title(f"{ws[0]['path']}, one batch of {ws[0]['batch']} split")
    fig.suptitle(f"rlplane bench, {results.get('date', '')}{' (--quick)' if results.get('config', {}).get('quick') else ''}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
