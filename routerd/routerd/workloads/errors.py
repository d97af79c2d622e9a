"""The one exception type of :mod:`routerd.workloads`.

Every message is a single line meant for a person at a terminal. Errors about a file
name the file, the row and the field, in this shape::

    azure.csv: row 17: field ContextTokens: 'abc' is not an integer

Row numbers are 1-based *line numbers in the file* (for a CSV the header is row 1, so
the first request is row 2), so ``row 17`` can be opened directly in an editor.
"""

from __future__ import annotations


class WorkloadError(ValueError):
    """Bad workload input: an unknown name, a missing or malformed file, a bad argument.

    Subclasses :class:`ValueError` so callers that already catch ``ValueError`` for bad
    input keep working. The message is always one line (see the module docstring).
    """


def row_error(path: object, row: int, field: str | None, problem: str) -> WorkloadError:
    """Build a :class:`WorkloadError` naming ``path``, ``row`` and (when known) ``field``."""
    where = f"{path}: row {row}"
    if field is not None:
        where += f": field {field}"
    return WorkloadError(f"{where}: {_one_line(problem)}")


def _one_line(text: str) -> str:
    # Messages embed raw file content (repr'd values, decoder errors); a stray newline
    # would break the one-line contract that log scrapers and CLIs rely on.
    return " ".join(str(text).split())
