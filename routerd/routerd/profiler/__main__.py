"""``python -m routerd.profiler [flags]``: the same as ``phasewise profile [flags]``."""

from __future__ import annotations

import argparse
import sys

from routerd.errors import ConfigError
from routerd.profiler.cli import add_parser, run


def main(argv: list[str] | None = None) -> int:
    """Parse ``profile`` flags and run; bad input prints one line and returns 2."""
    parser = argparse.ArgumentParser(prog="python -m routerd.profiler")
    sub = parser.add_subparsers(dest="command")
    add_parser(sub)
    args = parser.parse_args(["profile", *(sys.argv[1:] if argv is None else argv)])
    try:
        return run(args)
    except ConfigError as e:
        print(f"phasewise: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
