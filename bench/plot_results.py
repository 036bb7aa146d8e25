"""The plots and the derived tables of bench/RESULTS.md, from the raw files
in bench/results/ (the JSON that `halstm bench --json` writes, and the text
that `bench/gpu_cudnn_kernels.py --halstm` prints).

    .venv/bin/python bench/plot_results.py            # writes the PNGs below
    .venv/bin/python bench/plot_results.py --tables   # prints the tables (markdown)
    .venv/bin/python bench/plot_results.py --check    # results files RESULTS.md does not cite
    .venv/bin/python bench/plot_results.py --cold     # runs timed one cold call a round

A run's ratio is the one `halstm bench` reports (the median over its
interleaved rounds of the round's ratio, the `x_<peer>` field of the JSON);
a table's ms are the median over the runs of each run's median, its ratio
the median of the runs' ratios.
"""
import argparse
import json
import re
import statistics
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"

SHAPES = ["charrnn_512x2", "deepbench_1024", "large_2048", "small_128_b16", "latency_256_b1",
          "512x512x128x50x2"]
MODES = ["fwd", "fwdbwd"]

CPU = dict(runs=[f"cpu_s6b_run{k}.json" for k in (1, 2, 3)], peer="torch",
           context=[], title="CPU (2-core AMD EPYC, Zen 5): halstm / PyTorch",
           peer_name="PyTorch", png="ratios_cpu.png")
GPU = dict(runs=["gpu_h100_lstm_warm_1.json", "gpu_h100_lstm_warm_2.json"],
           peer="torch-cuda", context=[],
           title="GPU (H100): halstm / cuDNN (float32, TF32 off)",
           peer_name="cuDNN", png="ratios_gpu.png")
PROFILES = {"large_2048": "gpu_s10_kernels_final.txt",
            "deepbench_1024": "gpu_s10_kernels_final_deepbench.txt"}
PARTS = ["recurrent steps", "GEMMs", "pointwise", "weight packing", "other"]


def load(names):
    """[{(shape, mode, impl): row}] for each run file."""
    runs = []
    for n in names:
        rows = json.loads((RESULTS / n).read_text())["results"]
        runs.append({(r["shape"], r["mode"], r["impl"]): r for r in rows})
    return runs


def summary(spec):
    """Per (shape, mode): the peers' and halstm's median ms over the runs,
    halstm's GFLOP/s, each run's ratio to the peer, and their median."""
    runs = load(spec["runs"])
    out = []
    for shape in SHAPES:
        for mode in MODES:
            def rows(pred):
                return [r for run in runs for (s, m, i), r in run.items()
                        if s == shape and m == mode and pred(i)]
            ours = rows(lambda i: i.startswith("halstm"))
            if not ours:
                continue
            peer = rows(lambda i: i == spec["peer"])
            ratios = [r["x_" + spec["peer"]] for r in ours]
            out.append(dict(
                shape=shape, mode=mode,
                peer_ms=statistics.median(r["ms"] for r in peer),
                context_ms=[statistics.median(r["ms"] for r in rows(lambda i, c=c: i == c))
                            for c in spec["context"]],
                ms=statistics.median(r["ms"] for r in ours),
                gflops=statistics.median(r["gflops"] for r in ours),
                ratios=ratios, ratio=statistics.median(ratios)))
    return out


def table(spec):
    head = ["shape", "mode", f"{spec['peer_name']} ms"]
    head += [f"{spec['peer_name']} TF32 ms" for _ in spec["context"]]
    head += ["halstm ms", "GFLOP/s", "ratio per run", "median ratio"]
    lines = ["| " + " | ".join(head) + " |",
             "|---|---|" + "---:|" * (len(head) - 4) + "---|---:|"]
    for r in summary(spec):
        ratio = f"{r['ratio']:.2f}x"
        cells = [r["shape"], r["mode"], f"{r['peer_ms']:.3f}",
                 *[f"{c:.3f}" for c in r["context_ms"]], f"{r['ms']:.3f}",
                 f"{r['gflops']:.0f}", " / ".join(f"{x:.2f}" for x in r["ratios"]),
                 f"**{ratio}**" if r["ratio"] <= 1.0 else ratio]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def spread_table(spec):
    """Each side's median ms, lowest and highest run, per shape and mode."""
    runs = load(spec["runs"])
    peers = [spec["peer"], *spec["context"]]
    names = [spec["peer_name"], *[f"{spec['peer_name']} TF32" for _ in spec["context"]]]
    lines = ["| shape | mode | halstm ms | " + " | ".join(f"{n} ms" for n in names) + " |",
             "|---|---|" + "---|" * (1 + len(peers))]
    for shape in SHAPES:
        for mode in MODES:
            cells = []
            for pred in [lambda i: i.startswith("halstm")] + [lambda i, p=p: i == p for p in peers]:
                ms = [r["ms"] for run in runs for (s, m, i), r in run.items()
                      if s == shape and m == mode and pred(i)]
                cells.append(f"{min(ms):.3f}-{max(ms):.3f}")
            lines.append(f"| {shape} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def profile(name):
    """{side: {part: ms an iteration}} from a gpu_cudnn_kernels.py --halstm print."""
    text = (RESULTS / name).read_text()
    T = int(re.search(r"\bT=(\d+)", text).group(1))
    sides = {}
    for m in re.finditer(r"^== (\S+): .*?(\d+) iterations profiled(.*?)^Self CUDA", text,
                         re.M | re.S):
        side, its, body = m.group(1).rstrip(":"), int(m.group(2)), m.group(3)
        parts = dict.fromkeys(PARTS, 0.0)
        for line in body.splitlines():
            cols = re.split(r"\s{2,}", line.strip())
            if len(cols) != 11 or not cols[8].endswith("s") or cols[8].startswith("0.000"):
                continue
            kernel, total, calls = cols[0], cols[8], int(cols[10])   # CUDA total, # of Calls
            ms = float(total[:-2]) / (1000 if total.endswith("us") else 1) / its
            per_step = calls == its * T
            if re.search(r"step_out|dh_prev", kernel) or ("gemm" in kernel and per_step):
                part = "recurrent steps"
            elif re.search(r"_kernel_(xp|dx|dw_ih|dw_hh)_", kernel) or "gemm" in kernel:
                part = "GEMMs"
            elif re.search(r"dpre_out|elemWise|elementWise_bp1", kernel) and per_step:
                part = "pointwise"
            elif re.search(r"_kernel_wp_", kernel):
                part = "weight packing"
            else:
                part = "other"
            parts[part] += ms
        sides[side] = parts
    return sides


def profile_table():
    shapes = list(PROFILES)
    profs = {s: profile(PROFILES[s]) for s in shapes}
    head = "| ms an iteration | " + " | ".join(f"{s} halstm | {s} cuDNN" for s in shapes) + " |"
    lines = [head, "|---|" + "---:|" * (2 * len(shapes))]
    for part in PARTS + ["all kernels"]:
        cells = []
        for s in shapes:
            for side in ("halstm", "cuDNN"):
                p = profs[s][side]
                v = sum(p.values()) if part == "all kernels" else p[part]
                cells.append(f"{v:.2f}" if v else "none")
        lines.append(f"| {part} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_ratios(spec, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = summary(spec)
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.38
    colors = {"fwd": "#4c78a8", "fwdbwd": "#f58518"}
    labels = {"fwd": "forward", "fwdbwd": "forward + backward"}
    for k, mode in enumerate(MODES):
        mine = [r for r in rows if r["mode"] == mode]
        xs = [SHAPES.index(r["shape"]) + (k - 0.5) * width for r in mine]
        ax.bar(xs, [r["ratio"] for r in mine], width * 0.95, color=colors[mode],
               label=f"{labels[mode]} (median of {len(mine[0]['ratios'])} runs)")
        for x, r in zip(xs, mine):
            ax.plot([x] * len(r["ratios"]), r["ratios"], "k.", ms=4, zorder=3)
            ax.text(x, r["ratio"] / 2, f"{r['ratio']:.2f}", ha="center", va="center",
                    fontsize=8, color="white", fontweight="bold")
    ax.axhline(1.0, color="k", lw=0.8, ls="--", label=f"{spec['peer_name']}'s time")
    ax.set_xticks(range(len(SHAPES)), SHAPES, rotation=12)
    ax.set_xlim(-0.6, len(SHAPES) - 0.4)
    ax.set_ylim(0, 1.35)
    ax.set_ylabel(f"halstm time / {spec['peer_name']} time\n(below 1: halstm faster)")
    ax.set_title(spec["title"] + "; dots: each run", fontsize=10)
    ax.legend(loc="upper center", ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_profile(path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = ["#4c78a8", "#e45756", "#72b7b2", "#eeca3b", "#b0b0b0"]
    fig, axes = plt.subplots(1, len(PROFILES), figsize=(9, 3.4))
    for ax, (shape, name) in zip(axes, PROFILES.items()):
        prof = profile(name)
        sides = ["halstm", "cuDNN"]
        left = [0.0, 0.0]
        for part, color in zip(PARTS, colors):
            vals = [prof[s][part] for s in sides]
            ax.barh(sides, vals, left=left, color=color, label=part)
            for y, (v, l0) in enumerate(zip(vals, left)):
                if v > 0.06 * sum(prof[sides[y]].values()):
                    ax.text(l0 + v / 2, y, f"{v:.1f}", ha="center", va="center", fontsize=8)
            left = [a + b for a, b in zip(left, vals)]
        ax.set_title(f"{shape}, one forward + backward", fontsize=10)
        ax.set_xlabel("kernel ms an iteration (torch.profiler)")
        ax.invert_yaxis()
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=len(PARTS),
               fontsize=8)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def uncited():
    """Files in bench/results/ whose path RESULTS.md does not mention."""
    page = (BENCH / "RESULTS.md").read_text()
    return [p for p in sorted(RESULTS.iterdir()) if f"results/{p.name}" not in page]


def cold(limit_ms=50.0, block_ms=100.0):
    """(file, shape, mode, impl, ms, "cold" or "maybe") of every JSON row
    timed one call a round at under limit_ms a call. Where the row has
    its warm-up calls (warmup_ms), "cold" if the shortest took block_ms
    or more (no untimed call before each block); in files without them,
    "maybe": a first call of block_ms or more made such blocks cold, one
    of limit_ms to block_ms made blocks of one run after an untimed call."""
    out = []
    for p in sorted(RESULTS.glob("*.json")):
        try:
            rows = json.loads(p.read_text()).get("results", [])
        except (ValueError, AttributeError):
            continue
        for r in rows:
            if not (isinstance(r, dict) and "rounds_ms" in r
                    and r.get("runs") == len(r["rounds_ms"]) and r["ms"] < limit_ms):
                continue
            if "warmup_ms" not in r:
                out.append((p.name, r["shape"], r["mode"], r["impl"], r["ms"], "maybe"))
            elif min(r["warmup_ms"]) >= block_ms:
                out.append((p.name, r["shape"], r["mode"], r["impl"], r["ms"], "cold"))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", action="store_true", help="print the derived tables")
    ap.add_argument("--check", action="store_true",
                    help="list results files that RESULTS.md does not cite (exit 1 if any)")
    ap.add_argument("--cold", action="store_true",
                    help="list runs timed one cold call a round (see cold())")
    a = ap.parse_args()
    if a.cold:
        for row in cold():
            print("{} {} {} {} {:.3f} ms {}".format(*row))
        return
    if a.check:
        missing = uncited()
        for p in missing:
            print(p.relative_to(BENCH.parent))
        sys.exit(1 if missing else 0)
    if a.tables:
        print(f"CPU, {', '.join(CPU['runs'])}\n\n{table(CPU)}\n")
        print(f"GPU, {', '.join(GPU['runs'])}\n\n{table(GPU)}\n")
        print(f"GPU, lowest-highest run\n\n{spread_table(GPU)}\n")
        print(f"GPU kernels, {', '.join(PROFILES.values())}\n\n{profile_table()}")
        return
    for spec in (CPU, GPU):
        plot_ratios(spec, RESULTS / spec["png"])
        print(f"wrote {RESULTS / spec['png']}")
    plot_profile(RESULTS / "gpu_kernel_time.png")
    print(f"wrote {RESULTS / 'gpu_kernel_time.png'}")


if __name__ == "__main__":
    main()
