"""User-facing errors: one line, what is wrong and what would be right.

Everything raised as `HpcparError` is reported by the CLI as a single line
(`hpcpar: error: ...`) with exit status 2 and no traceback unless `--debug`.
Anything else is a bug or a fault and takes the fail-together path (traceback
tagged with the rank, then MPI_Abort).
"""

import traceback


class HpcparError(Exception):
    """An error in what the user asked for (config, flags, paths, checkpoints)."""

    exit_status = 2

    def __str__(self) -> str:
        # One line, whatever the message quotes: a name read from a crafted file may hold a newline.
        return super().__str__().replace("\r", "\\r").replace("\n", "\\n")


class UsageError(HpcparError):
    """A command line that does not parse (an unknown flag, a missing value)."""


class ConfigError(HpcparError):
    """A configuration value or combination that cannot work."""


class MeshError(HpcparError):
    """The requested (dp, tp, pp) mesh does not fit the world."""


class DataError(HpcparError):
    """A corpus path that is missing, empty or unreadable."""


class CheckpointError(HpcparError):
    """A checkpoint that is missing, corrupt, truncated or of another model."""


def user_error_text(err: BaseException, debug: bool = False) -> str:
    """How a user error is printed: `hpcpar: error: <msg>`, after its traceback when `debug`."""
    details = "".join(traceback.format_exception(type(err), err, err.__traceback__)) if debug else ""
    return details + f"hpcpar: error: {err}\n"
