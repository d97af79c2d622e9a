"""Errors shared by the data-plane commands (serve, sidecar, emulate, profile)."""


class ConfigError(ValueError):
    """Bad configuration or command-line input; the message names the file, field or flag.

    ``phasewise`` prints it on one line and exits with status 2 (no traceback).
    """
