"""Command line: grain-replay info | convert | verify | stats | demo (parser and dispatch)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from grain_replay.cli.commands import cmd_convert, cmd_stats, cmd_verify
from grain_replay.cli.demo import cmd_demo
from grain_replay.cli.info import cmd_info
from grain_replay.cli.remote import add_storage_option

__all__ = ["main"]


_VERIFY_EPILOG = """\
exit status:
  0  the store is readable and every recorded checksum matches
  1  the store is corrupt: the first damaged leaf and row range are named, or
     opening it hung or crashed the child process it is first opened in
  2  the store cannot be opened or an argument is wrong (one error line)
"""


# Descriptions and epilogs are wrapped by hand (RawDescriptionHelpFormatter keeps
# the exit-status table); defaults are written into the help strings with
# %(default)s where an argument has one, rather than ArgumentDefaultsHelpFormatter's
# "(default: None)" after every flag.
_HelpFormatter = argparse.RawDescriptionHelpFormatter
# What verify and stats read.
_ANY_STORE = "a store, a Minari or LeRobot dataset, or a D4RL .hdf5 file"


def _command(sub: Any, name: str, func: Any, **kwargs: Any) -> Any:
    """A subcommand's parser (help, description, epilog in ``kwargs``) that runs ``func``."""
    p = sub.add_parser(name, formatter_class=_HelpFormatter, **kwargs)
    p.set_defaults(func=func)
    return p


def _add_info(sub: Any) -> None:
    p = _command(
        sub,
        "info",
        cmd_info,
        help="show format, records, leaves, episodes and size (writes nothing)",
        description="Shows a store's format, records, leaves (dtype, shape), episodes and\n"
        "size on disk. Read-only: it works on a read-only store and writes nothing\n"
        "unless --cache-episodes is given.",
    )
    p.add_argument(
        "path",
        help="a store: .h5/.hdf5 file, .zarr group or .npy directory/file, or an URL "
        "(s3://...: a many-writer store, or a Zarr store)",
    )
    add_storage_option(p)
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument(
        "--cache-episodes",
        action="store_true",
        help="also write the episode index beside the store, where the RL views reuse it",
    )


def _add_convert(sub: Any) -> None:
    from grain_replay.writers.oneshot import HDF5_COMPRESSIONS, ZARR_COMPRESSIONS

    compressions = sorted({*HDF5_COMPRESSIONS, *ZARR_COMPRESSIONS})
    p = _command(
        sub,
        "convert",
        cmd_convert,
        help="copy a store into another format, bit-exactly",
        description="Copies SRC into a new store at DST, bit-exactly, streaming in bounded\n"
        "memory. An interrupted convert leaves nothing behind.",
    )
    p.add_argument("src", help="any store, a Minari or LeRobot dataset, or a D4RL .hdf5 file")
    add_storage_option(p)
    p.add_argument(
        "dst", help="destination: .h5/.hdf5 writes HDF5, .zarr writes Zarr, else .npy directory"
    )
    p.add_argument(
        "--format", choices=["hdf5", "npy", "zarr"], help="format of DST (default: from its name)"
    )
    p.add_argument(
        "--chunk-rows", type=int, metavar="ROWS", help="rows per chunk (default: contiguous)"
    )
    p.add_argument(
        "--compression",
        choices=compressions,
        help=f"HDF5: {', '.join(HDF5_COMPRESSIONS)}; Zarr: {', '.join(ZARR_COMPRESSIONS)}; "
        ".npy: none (default: uncompressed)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.add_argument(
        "--block-bytes",
        type=int,
        default=64 << 20,
        metavar="BYTES",
        help="bytes of records read and written at a time, which bounds the memory used "
        "(default: %(default)s = 64 MiB)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _add_verify(sub: Any) -> None:
    p = _command(
        sub,
        "verify",
        cmd_verify,
        help="check metadata, lengths and checksums; exit 0 ok, 1 corrupt, 2 error",
        description="Reads every leaf of a store and checks its metadata, lengths and\n"
        "recorded checksums.",
        epilog=_VERIFY_EPILOG,
    )
    p.add_argument("path", help=_ANY_STORE)
    add_storage_option(p)
    p.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="open the store first in a child process killed after this long: a hostile "
        "HDF5 file can hang the HDF5 library (default: %(default)s; 0: no child)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _add_stats(sub: Any) -> None:
    p = _command(
        sub,
        "stats",
        cmd_stats,
        help="per-leaf count, mean, std, min, max, quantiles",
        description="Per-leaf count, mean, std, min, max and quantiles, in one streaming\n"
        "pass; cached beside the store unless --no-cache.",
    )
    p.add_argument("path", help=_ANY_STORE)
    add_storage_option(p)
    p.add_argument("--json", action="store_true", help="machine-readable output (NaN -> null)")
    p.add_argument("--keys", nargs="+", help="leaves or groups (default: all)")
    p.add_argument(
        "--quantiles",
        nargs="+",
        type=float,
        default=[0.01, 0.1, 0.5, 0.9, 0.99],
        metavar="Q",
        help="quantiles in [0, 1] (default: %(default)s)",
    )
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the cache")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _add_demo(sub: Any) -> None:
    p = _command(
        sub,
        "demo",
        cmd_demo,
        help="write a synthetic replay in each format and stream it back",
        description="Writes a synthetic replay of transitions as HDF5, .npy and Zarr, then\n"
        "streams one shuffled epoch of each through make_data_loader and\n"
        "sharded_device_put, and prints the rates.",
    )
    p.add_argument(
        "--out", default="demo_out", help="directory the stores go to (default: %(default)s)"
    )
    p.add_argument(
        "--records", type=int, default=200_000, help="transitions per store (default: %(default)s)"
    )
    p.add_argument(
        "--batch-size", type=int, default=256, help="records per batch (default: %(default)s)"
    )
    p.add_argument(
        "--workers", type=int, default=2, help="loader worker processes (default: %(default)s)"
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``grain-replay`` parser: one ``_add_<command>`` per subcommand."""
    from grain_replay import __version__

    parser = argparse.ArgumentParser(
        prog="grain-replay",
        description="Inspect, convert, verify, describe and demo grain_replay stores (HDF5, .npy,\n"
        "Zarr).",
        epilog="Run 'grain-replay COMMAND --help' for a command's arguments. Expected\n"
        "failures print one 'grain-replay: error: ...' line and exit with status 2.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_info(sub)
    _add_convert(sub)
    _add_verify(sub)
    _add_stats(sub)
    _add_demo(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``grain-replay``; returns the exit status (2 for every expected failure)."""
    args = build_parser().parse_args(argv)
    from grain_replay.errors import GrainReplayError

    try:
        return int(args.func(args))
    except (GrainReplayError, OSError) as e:
        # Expected failures (bad input, missing or unwritable paths): one line, argparse's form.
        print(f"grain-replay: error: {e}", file=sys.stderr)
        return 2
