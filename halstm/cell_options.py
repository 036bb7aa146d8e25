"""The command line's --cell and --cell-file options (compile, train)."""
from __future__ import annotations

import click

from . import cells


def load_cell_files(ctx, param, paths):
    """--cell-file (eager): register each file's cell definitions."""
    for path in paths or ():
        try:
            cells.load_file(path)
        except (cells.CellError, OSError) as e:
            raise click.BadParameter(str(e), ctx=ctx, param=param) from None
    return paths


def check_cell(ctx, param, name):
    """--cell: a built-in cell or one that --cell-file registered."""
    try:
        return cells.check(name)
    except ValueError as e:
        raise click.BadParameter(f"{e}; a cell of your own needs --cell-file FILE", ctx=ctx,
                                 param=param) from None


def cell_file_option(f):
    """--cell-file FILE (repeatable)."""
    return click.option("--cell-file", multiple=True, is_eager=True, expose_value=False,
                        callback=load_cell_files, type=click.Path(dir_okay=False),
                        help="A Python file of cell definitions to load first "
                             "(repeatable).")(f)


def cell_options(f):
    f = click.option("--cell", default="lstm", show_default=True, callback=check_cell,
                     help="A cell name (halstm cells lists them), built in or from "
                          "--cell-file.")(f)
    return cell_file_option(f)
