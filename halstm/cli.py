"""The `halstm` command line."""
from __future__ import annotations

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="halstm")
def main():
    """Fast LSTM and GRU kernels generated with Halide: compile, inspect,
    benchmark, and train a char-level language model."""


def _register():
    from .model.commands import sample, train
    main.add_command(train)
    main.add_command(sample)


_register()

if __name__ == "__main__":
    main()
