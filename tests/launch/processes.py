"""Process checks shared by the launch tests (Linux /proc)."""

from __future__ import annotations


def alive(pid: int) -> bool:
    """True if `pid` runs (a zombie counts as gone: it has exited, only its status is left)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
