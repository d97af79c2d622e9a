"""``python -m routerd.daemon [flags]``: the same as ``phasewise serve [flags]``."""

from routerd.cli import run_data_plane_command


def main(argv: list[str] | None = None) -> int:
    """Run ``phasewise serve`` with ``argv`` (default: the process arguments); returns the exit code."""
    return run_data_plane_command("serve", argv)


if __name__ == "__main__":
    raise SystemExit(main())
