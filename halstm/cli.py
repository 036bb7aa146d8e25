"""The `halstm` command line: targets, compile, inspect, bench, tune, train, sample."""
from __future__ import annotations

import json
import time
from pathlib import Path

import click

from . import aot, cells, cublas, machine
from .cell_options import cell_file_option, cell_options
from .errors import CacheError, KernelError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="halstm")
def main():
    """Fast recurrent kernels (LSTM, GRU, RNN, cells of your own) generated
    with Halide: list cells, compile, inspect,
    benchmark, and train a char-level language model."""


def _halide_target(value: str) -> str:
    import halide as hl
    if not hl.Target.validate_target_string(value):
        raise click.BadParameter(f"{value!r} is not a Halide target string "
                                 f"(e.g. host, host-cuda-cuda_capability_80, arm-64-linux)")
    return value


def _target_option(f):
    return click.option("--target", default="host", show_default=True,
                        callback=lambda ctx, p, v: _halide_target(v),
                        help="Halide target string: host, host-cuda, arm-64-linux, ...")(f)


def _positive(ctx, param, value):
    if value is not None and value < 1:
        raise click.BadParameter(f"expected a positive integer, got {value}")
    return value


def _cuda_status() -> str:
    """Whether a CUDA driver and GPU are usable here, in words."""
    from halstm import cuda
    try:
        d = cuda.driver()
    except cuda.CudaError as e:
        return f"not usable: {e}"
    major, minor = cuda.capability()
    return (f"usable: {d.name} (compute capability {major}.{minor}); "
            f"host-cuda means {cuda.host_target('host-cuda')}")


@main.command()
def targets():
    """Show the host target, its features, GPU availability and schedules."""
    import halide as hl
    from halstm import bf16, schedules
    host = str(hl.get_host_target())
    arch, bits, os_, *features = host.split("-")
    click.echo(f"host target:  {host}")
    click.echo(f"architecture: {arch}-{bits}-{os_}")
    click.echo(f"features:     {', '.join(features) or '(none)'}")
    click.echo(f"cuda:         {_cuda_status()}")
    click.echo(f"machine:      {machine.summary()}")
    where = bf16.host_products()
    click.echo(f"precisions:   fp32; bf16 {where or 'not on this CPU'}"
               f" (cpu targets); tf32, bf16 by cuBLAS (cuda targets)")
    click.echo("schedules:")
    for name in schedules.names():
        fams = ", ".join(sorted(schedules.families(name)))
        default = [f for f in ("cpu", "gpu") if schedules.default_for(f) == name]
        note = f"  (default for {', '.join(default)} targets)" if default else ""
        click.echo(f"  {name:10s} {fams}{note}")


@main.command("cells")
@cell_file_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def cells_command(as_json):
    """List the cells: gates, states, parameters, and what backward reads."""
    rows = []
    for name in cells.names():
        d = cells.info(name)
        G = len(d["gates"])
        gh = "H" if G == 1 else f"{G}H"
        params = {"weight_ih_l{k}": f"({gh}, I or H)", "weight_hh_l{k}": f"({gh}, H)"}
        if d["matrix_bias"]:
            params |= {"bias_ih_l{k}": f"({gh},)", "bias_hh_l{k}": f"({gh},)"}
        for v in d["vectors"]:
            init = "uniform +-1/sqrt(H)" if v["init"] == "uniform" else f"{v['init']:g}"
            params[v["name"] + "_l{k}"] = (f"({gh if v['per_gate'] else 'H'},) starts at {init}"
                                           + (", a bias" if v["bias"] else ""))
        kind = "built in" if name in cells.NAMES else "from a file"
        rows.append(d | {"parameters": params, "origin": kind})
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for r in rows:
        click.echo(f"{r['name']}  ({r['origin']})")
        if r["doc"]:
            click.echo(f"  {r['doc'].splitlines()[0]}")
        click.echo(f"  gates {', '.join(r['gates'])}; states {', '.join(r['states'])}; "
                   f"saved for backward {', '.join(r['saved'])}"
                   + ("; reduces over the hidden units" if r["reduces"] else ""))
        click.echo("  parameters per layer k: " + ", ".join(f"{k} {v}" for k, v in
                                                           r["parameters"].items()))


@main.command()
@cell_options
@click.option("--input-size", "-i", type=int, required=True, callback=_positive)
@click.option("--hidden-size", "-H", type=int, required=True, callback=_positive)
@click.option("--layers", type=int, default=1, show_default=True, callback=_positive)
@_target_option
@click.option("--schedule", default=None, help="Schedule name (default: the target's best).")
@click.option("--out", "-o", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Output folder (default: ./<cell>_i<I>_h<H>).")
@click.option("--emit", multiple=True, type=click.Choice(sorted(aot.EMIT)),
              help="Also write this Halide output per pipeline (repeatable).")
@click.option("--precision", type=click.Choice(list(cublas.PRECISIONS)), default="fp32",
              show_default=True, help="tf32, bf16: the projection and gradient GEMMs in "
              "TF32 / bf16 tensor-core math by cuBLAS (CUDA targets); bf16 on a CPU with "
              "AMX or AVX512-BF16: every product in bf16 with fp32 sums; storage, states "
              "and the cell stay fp32.")
@click.option("--gemm", type=click.Choice(["halide", "cublas"]), default=None,
              help="Who runs the projection and gradient GEMMs on a CUDA target (default: "
                   "cuBLAS where it is installed, else Halide).")
def compile(cell, input_size, hidden_size, layers, target, schedule, out, emit, precision,
            gemm):
    """Compile forward and backward kernels for a model into a folder.

    For a target that runs here the folder holds loadable libraries
    (halstm.load(DIR) runs them); for a cross target, static libraries,
    headers and the driver source to build into a C or C++ program."""
    from . import compiled
    out = out or Path(f"{cell}_i{input_size}_h{hidden_size}")
    try:
        aot.Spec(cell, input_size, hidden_size, "fwd", target, schedule, precision=precision,
                 gemm=gemm)
    except ValueError as e:
        hint = next((f"--{o}" for o in ("precision", "gemm") if str(e).startswith(o + ":")),
                    "--schedule")
        raise click.BadParameter(str(e), param_hint=hint) from None
    try:
        compiled.check_out(out)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--out") from None
    try:
        out.parent.resolve().mkdir(parents=True, exist_ok=True)
        probe = out.parent.resolve() / f".{out.name}.probe"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise click.BadParameter(f"cannot write to {out}: {e.strerror}", param_hint="--out")

    def progress(name, m):
        click.echo(f"  {name}: {m['compile_seconds']:.1f} s", err=True)

    click.echo(f"compiling {cell} (input {input_size}, hidden {hidden_size}, {layers} "
               f"layer(s)) for {target} ...", err=True)
    try:
        top = compiled.compile_model(cell, input_size, hidden_size, layers, target, schedule,
                                     out, emit, progress, precision=precision, gemm=gemm)
    except aot.CompileError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"wrote {out}/ (target {top['target']}, schedule {top['schedule']})")
    if not top["loadable_here"]:
        click.echo("this target cannot run here: each part holds static libraries (.a), "
                   "headers (.h), the Halide runtime and driver.cpp for embedding in a C or "
                   "C++ program; its manifest.json gives the build command")


@main.command()
@click.argument("folder", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the raw manifests as JSON.")
def inspect(folder, as_json):
    """Describe a folder written by `halstm compile`."""
    from . import compiled
    try:
        top = compiled.read(folder)
        parts = [compiled.read(folder / p["dir"]) for p in top.get("parts", [])]
    except (FileNotFoundError, ValueError, KeyError, TypeError) as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps({"model": top, "parts": parts}, indent=2))
        return
    for key in ("cell", "input_size", "hidden_size", "num_layers", "target", "schedule",
                "precision", "gemm", "halide_version", "loadable_here"):
        click.echo(f"{key + ':':16s}{top.get(key)}")
    for part, m in zip(top.get("parts", []), parts):
        kind = m["library"] or "static libraries + driver.cpp"
        click.echo(f"\n{part['dir']}: {m['direction']} input {m['input_size']}, panel "
                   f"{m['panel']}, {kind}, compiled in {m['compile_seconds']:.1f} s")
        click.echo(f"  pipelines: {', '.join(m['pipelines'])}")
        for note in m.get("schedule_notes", []):      # the schedule's shape-dependent choices
            click.echo(f"  schedule: {note}")
        if m.get("knobs"):                             # values halstm tune kept here
            click.echo("  knobs: " + ", ".join(f"{k}={v}" for k, v in m["knobs"].items()))
        for entry, args in m["entry_points"].items():
            click.echo(f"  {entry}(" + ", ".join(args) + ")")
        if m.get("driver_build"):
            click.echo(f"  build: {m['driver_build']}")


@main.command()
@click.option("--shapes", default="small_128_b16", show_default=True,
              help="Comma-separated shapes: names from the shared set, or sizes "
                   "IxHxBxTxL (input, hidden, batch, steps, layers), e.g. 512x512x128x50x2; "
                   "or 'all' (the shared set).")
@cell_options
@click.option("--schedules", "schedule_list", default=None,
              help="Comma-separated schedules (default: the target's default), each "
                   "SCHEDULE[@OPTION...] with options tf32, bf16 (precision) and halide or cublas "
                   "(who runs the projection and gradient GEMMs on a GPU), e.g. "
                   "default@halide,default@cublas,default@tf32,default@bf16.")
@_target_option
@click.option("--peers", default="numpy,torch", show_default=True,
              help="Comma-separated peers to time beside halstm: numpy, torch (the "
                   "cell's torch.nn module, where torch has one), torch_tf32 (cuDNN with TF32; "
                   "GPU targets), torch_bf16 (the module in bfloat16), torch_eager (the "
                   "cell's step in PyTorch eager, stepped from Python), torch_lstm "
                   "(torch.nn.LSTM at the same shape, whatever the cell), lstm (halstm's LSTM "
                   "at the same shape); '' for none.")
@click.option("--fwd/--fwdbwd", "fwd_only", default=None,
              help="Forward only, or forward+backward (default: both).")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="Interleaved rounds per shape and mode at least (each implementation "
                   "also gets a second of timed runs): more rounds, steadier ratios.")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path))
def bench(shapes, cell, schedule_list, target, peers, fwd_only, rounds, csv_path, json_path,
          plot_path):
    """Time schedules against peers on the shared benchmark shapes.

    Each halstm result is checked against the numpy reference before it is
    timed. Per shape and mode, every implementation runs once per round,
    rounds interleaved, after a warm-up: times are medians, and a ratio to a
    peer is the median of the per-round ratios, so that load on a shared
    machine hits both sides alike. Forward passes run under halstm.no_grad()
    (PyTorch's under torch.no_grad()). Columns steal and others: the share
    of CPU time the hypervisor gave other guests, and other processes of
    this machine used, while a shape was timed."""
    from . import benchmark as B
    names = list(B.shapes()) if shapes == "all" else [s.strip() for s in shapes.split(",") if s]
    if not names:
        raise click.BadParameter("expected shape names, got none", param_hint="--shapes")
    for n in names:
        try:
            B.shape(n)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--shapes") from None
    scheds = [s.strip() for s in schedule_list.split(",")] if schedule_list else [None]
    for s in scheds:
        try:
            name, kw = B.variant(s)
            aot.Spec(cell, 1, 1, "fwd", target, name, **kw)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--schedules") from None
    peer_list = [p.strip() for p in peers.split(",") if p.strip()]
    bad = [p for p in peer_list if p not in B.PEERS]
    if bad:
        raise click.BadParameter(f"unknown peer(s) {bad}; known: {', '.join(B.PEERS)}",
                                 param_hint="--peers")
    modes = ["fwd", "fwdbwd"] if fwd_only is None else (["fwd"] if fwd_only else ["fwdbwd"])
    try:
        results, notes = B.run(names, cell, scheds, target, peer_list, modes, progress=True,
                               timing={"min_runs": rounds})
    except (aot.CompileError, CacheError, KernelError, AssertionError) as e:
        raise click.ClickException(str(e)) from None
    for note in notes:
        click.echo(f"note: {note}", err=True)
    click.echo(f"machine: {machine.summary()}")
    click.echo(B.table(results))
    if csv_path:
        B.write_csv(results, csv_path)
    if json_path:
        B.write_json(results, json_path)
    if plot_path:
        B.plot(results, plot_path)
    for path in (csv_path, json_path, plot_path):
        if path:
            click.echo(f"wrote {path}", err=True)


@main.command()
@cell_options
@click.option("--shape", default=None,
              help="A shape of the shared set (halstm bench's names): its layers' sizes, B, T.")
@click.option("--sizes", default=None, metavar="I,H,B,T[,L]",
              help="Or the sizes: input, hidden, batch, steps, layers (default 1).")
@_target_option
@click.option("--schedule", default=None, help="Schedule name (default: the target's best).")
@click.option("--knob", "knob_names", multiple=True,
              help="Tune this knob only (repeatable; default: every knob of the schedule).")
@click.option("--budget", type=float, default=300.0, show_default=True,
              help="Seconds for the whole search; values not reached are reported skipped.")
@click.option("--rounds", type=int, default=11, show_default=True, callback=_positive,
              help="Alternating timing rounds per direction (the first two left out).")
@click.option("--precision", type=click.Choice(["fp32", "tf32", "bf16"]), default="fp32",
              show_default=True, help="Tune the layers of this precision (tf32: a CUDA "
              "target; bf16: a CUDA target or a CPU with AMX or AVX512-BF16); each "
              "precision keeps its own values.")
@click.option("--report", is_flag=True, help="Print what was tuned on this machine and exit.")
def tune(cell, shape, sizes, target, schedule, knob_names, budget, rounds, precision, report):
    """Measure the schedule's knobs on this machine for a model's layers
    and keep the fastest (in the kernel cache's tuning.json); compile, the
    modules and the char LM then use them. Every value is checked against
    the default's results before it is timed, and kept only where it beats
    the current choice."""
    from . import tuning
    from .benchmark import shapes as shared
    if report:
        for line in tuning.report_lines(target):
            click.echo(line)
        return
    if (shape is None) == (sizes is None):
        raise click.UsageError("give --shape NAME or --sizes I,H,B,T[,L] (one of them)")
    if shape is not None:
        known = shared()
        if shape not in known:
            raise click.BadParameter(f"expected one of {sorted(known)}, got {shape!r}",
                                     param_hint="--shape")
        s = known[shape]
    else:
        try:
            v = [int(a) for a in sizes.split(",")]
            if len(v) not in (4, 5) or min(v) < 1:
                raise ValueError
        except ValueError:
            raise click.BadParameter(f"expected 4 or 5 positive ints I,H,B,T[,L], got "
                                     f"{sizes!r}", param_hint="--sizes") from None
        s = dict(zip("IHBTL", v + [1]))
    layers = [s["I"]] + ([s["H"]] if s["L"] > 1 else [])     # the layers' distinct input sizes
    start = time.perf_counter()
    for k, K in enumerate(layers):
        left = budget - (time.perf_counter() - start)
        try:
            found = tuning.tune(cell, K, s["H"], s["B"], s["T"], target, schedule,
                                list(knob_names) or None, left / (len(layers) - k), rounds,
                                precision=precision)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
        except aot.CompileError as e:
            raise click.ClickException(str(e)) from None
        for layer, e in found.items():
            kept = ", ".join(f"{a}={b}" for a, b in e["knobs"].items()) or "defaults"
            steps = "; ".join(f"{st['knob']} {st['base_ms']} ms -> kept {st['kept']}"
                              for st in e["by_knob"])
            click.echo(f"{layer}: {kept} ({steps})")


def _register_model_commands():
    from .model.commands import sample, train
    main.add_command(train)
    main.add_command(sample)


_register_model_commands()

if __name__ == "__main__":
    main()
