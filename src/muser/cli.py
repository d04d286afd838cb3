"""`muser` command line. Each subcommand lives in `muser.commands.<name>` and exposes
`register(subparsers)`; modules keep heavy imports inside their run functions so `--help` is fast.

Bad input ends in one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from .errors import MuserError


def build_parser() -> argparse.ArgumentParser:
    from . import __version__, commands

    parser = argparse.ArgumentParser(prog="muser", description="Muse Glimmer inference engine")
    parser.add_argument("--version", action="version", version=f"muser {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{commands.__name__}.{info.name}")
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc = args.func(args)
        return int(rc or 0)
    except MuserError as e:
        print(f"muser: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("muser: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except OSError as e:
        # Missing files, permissions, full disks: one line, the path named.
        where = f" {e.filename!r}" if getattr(e, "filename", None) else ""
        print(f"muser: error:{where} {e.strerror or e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
