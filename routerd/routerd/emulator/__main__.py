"""``python -m routerd.emulator [flags]``: the same as ``phasewise emulate [flags]``."""

from routerd.cli import run_data_plane_command


def main(argv: list[str] | None = None) -> int:
    """Run ``phasewise emulate`` with ``argv`` (default: the process arguments); returns the exit code."""
    return run_data_plane_command("emulate", argv)


if __name__ == "__main__":
    raise SystemExit(main())
