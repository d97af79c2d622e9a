"""``python -m routerd.profiler [flags]``: the same as ``phasewise profile [flags]``."""

from routerd.cli import run_data_plane_command


def main(argv: list[str] | None = None) -> int:
    """Run ``phasewise profile`` with ``argv`` (default: the process arguments); returns the exit code."""
    return run_data_plane_command("profile", argv)


if __name__ == "__main__":
    raise SystemExit(main())
