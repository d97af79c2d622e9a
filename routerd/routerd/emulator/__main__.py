"""``python -m routerd.emulator [flags]``: the same as ``phasewise emulate [flags]``."""

from __future__ import annotations

import argparse
import sys

from routerd.emulator.cli import add_parser, run
from routerd.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    """Parse ``emulate`` flags and serve; bad settings print one line and return 2."""
    parser = argparse.ArgumentParser(prog="python -m routerd.emulator")
    sub = parser.add_subparsers(dest="command")
    add_parser(sub)
    args = parser.parse_args(["emulate", *(sys.argv[1:] if argv is None else argv)])
    try:
        return run(args)
    except ConfigError as e:
        print(f"phasewise: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
