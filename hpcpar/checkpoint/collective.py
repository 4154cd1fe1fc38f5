"""Every checkpoint failure is collective: all ranks raise the same `CheckpointError`, never one
raising while the others wait (`runtime.agreement.agree` with `error=CheckpointError`), and a full
disk, which HDF5 reports inside a long multi-line text, is named with its remedy."""

from __future__ import annotations

import errno
import re
from typing import TYPE_CHECKING, Any, Callable

from hpcpar.errors import CheckpointError
from hpcpar.runtime.agreement import agree, one_line

if TYPE_CHECKING:
    from hpcpar.runtime.comm import Communicator
    from hpcpar.runtime.solo import SoloCommunicator


def collective(comm: Communicator | SoloCommunicator, work: Callable[[], Any], share: bool = False,
               patient: bool = False) -> Any:
    """Run `work` on every rank; if it fails anywhere, raise the same CheckpointError everywhere.
    Returns this rank's result, or with `share` every rank's (list by rank: small objects only);
    `patient`: the ranks finish `work` far apart (it writes or reads data). See `agree`."""
    return agree(comm, work, share=share, patient=patient, error=CheckpointError, describe=_failure)


def _failure(err: BaseException) -> str:
    """`err` as one line; a full disk says so, and where."""
    text = " ".join(str(err).split())
    if getattr(err, "errno", None) == errno.ENOSPC or "errno = 28" in text:
        where = re.search(r"filename = '([^']+)'", text)
        path = getattr(err, "filename", None) or (where.group(1) if where else "the checkpoint")
        return (f"no space left on device writing {path}; free space or set checkpoint.dir to a file "
                "system with room")
    return one_line(err)
