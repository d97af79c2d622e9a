"""``python -m routerd.daemon [flags]``: the same as ``phasewise serve [flags]``."""

import argparse
import sys

from routerd.daemon import cli
from routerd.errors import ConfigError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m routerd.daemon")
    sub = parser.add_subparsers(dest="command")
    cli.add_parser(sub)
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    try:
        return cli.run(args)
    except ConfigError as e:
        print(f"phasewise: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
