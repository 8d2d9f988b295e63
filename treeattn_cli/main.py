"""Command line: ``treeattn generate | topo | bench``. Parses, validates, calls one function."""

from __future__ import annotations

import sys

import typer

from . import __version__

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Exact long-context decoding across GPUs with Tree Attention.",
    pretty_exceptions_enable=False,
)


def _not_yet(what: str) -> None:
    typer.echo(f"treeattn {what}: not implemented yet", err=True)
    raise typer.Exit(1)


def _version(value: bool):
    if value:
        typer.echo(f"treeattn {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")):
    """Exact long-context decoding across GPUs with Tree Attention."""


@app.command()
def generate():
    """Load a model, shard a long prompt's KV cache across ranks, stream tokens."""
    _not_yet("generate")


@app.command()
def topo():
    """Probe the interconnect (NVLink, PCIe, Infinity Fabric) and choose the reduction layout."""
    _not_yet("topo")


@app.command()
def bench():
    """Compare tree vs ring vs one device on the same attention work."""
    _not_yet("bench")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
