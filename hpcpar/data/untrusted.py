"""Files hpcpar did not write: the names they give stay in their directory, and what they claim
is bounded by what they hold.

Checkpoints, safetensors, token directories and tokenizers travel between people and sites, so
hpcpar reads files anyone may have crafted (a manifest's sha256 guards against corruption, not
against a file written to mislead). Two rules, stated once here and applied by every reader:

- **Containment** (`contained`): a name one file gives for another (a manifest's block file,
  meta.json's tokenizer, a weight map's shard) is a relative path without `..`; joined to the
  directory that holds it, its real path (every symbolic link resolved) lies inside that
  directory's real path (or a `root` above it: a HuggingFace cache snapshot's links point into
  its repository's blobs/). Inside HDF5 files (`check_hdf5`): an external link or a virtual
  dataset's source file must be contained the same way, relative to the file's directory; a
  dataset whose raw data lives in external files (`H5Pset_external`: HDF5 resolves those against
  the working directory) is refused outright. hpcpar writes none of these but the index's
  virtual datasets over the rank files beside it.
- **Bounded reads** (`read_text`, `read_json`): a JSON or TOML file larger than its kind can be
  is refused before it is read; JSON nested too deep for the parser is refused, not a crash.
  What a header claims (sizes, offsets, shapes, ids) is checked against the bytes that hold it
  by each reader before it allocates for it.

Either refusal is the reader's `HpcparError` subclass (`error`), one line naming the file and
the entry, raised before anything is read from the named file.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from hpcpar.errors import DataError, HpcparError

if TYPE_CHECKING:  # h5py loads where an HDF5 file is checked only: config and planner read JSON/TOML here
    import h5py

MiB = 1 << 20


def contained(directory: str, name, what: str, error: type[HpcparError] = DataError, root: str | None = None) -> str:
    """`os.path.join(directory, name)` once it is known to resolve inside `root` (default `directory`).

    Args:
        directory: the directory the name is relative to (the file that gives it lives there).
        name: the name as the file gives it (anything JSON may hold: checked to be a string).
        what: the file and entry that give it, for the message ("<ckpt>/manifest.json: block file").
        error: the HpcparError subclass to raise.
        root: the directory the name must stay in, when it is above `directory`.
    Raises:
        `error`: an empty or non-string name, an absolute path, a `..` part, or a path whose real
        path (symbolic links resolved) leaves `root`.
    """
    shown = name if isinstance(name, str) else json.dumps(name, default=str)[:80]
    if not isinstance(name, str) or not name or "\0" in name:
        raise error(f"{what} {shown!r} is not a file name; expected a name inside {directory}")
    parts = name.replace("\\", "/").split("/")
    if os.path.isabs(name) or name.startswith(("/", "\\")) or ".." in parts:
        raise error(f"{what} {name!r} leads outside {root or directory} (absolute paths and '..' are refused: "
                    "a file may only name files beside it); the file was crafted or damaged")
    path = os.path.join(directory, name)
    base = os.path.realpath(root or directory)
    real = os.path.realpath(path)
    if os.path.commonpath([base, real]) != base:
        raise error(f"{what} {name!r} is a symbolic link that leads outside {root or directory} (to {real}); "
                    "copy the file in instead of linking it")
    return path


def check_hdf5(f: h5py.File, directory: str, what: str, error: type[HpcparError] = DataError) -> None:
    """Refuse an open HDF5 file whose links or datasets reach outside `directory` (see above).

    Visits every link of the file without following any (H5Lvisit): external links and virtual
    datasets' source files must be `contained` in `directory` (the file's own: HDF5 resolves their
    relative names there); datasets with external raw-data files are refused. Reads no data.
    """
    import h5py

    problems: list[str] = []
    inside: set[str] = set()  # names found contained (an index names one rank file hundreds of times)

    def check(target: str, entry: str) -> None:
        if target not in inside:
            contained(directory, target, f"{what}: {entry}", error)
            inside.add(target)

    def visit(name: bytes, info) -> int | None:
        # The low-level calls (H5Lvisit, H5Oopen, the creation property list): h5py's Dataset
        # properties cost ~3x as much over an index of 450 tensors.
        path = name.decode(errors="replace")
        try:
            if info.type == h5py.h5l.TYPE_EXTERNAL:
                check(f.id.links.get_val(name)[0].decode(errors="replace"), f"external link /{path} to")
            elif info.type == h5py.h5l.TYPE_HARD:  # (a soft link names a path in this file)
                oid = h5py.h5o.open(f.id, name)
                if h5py.h5i.get_type(oid) == h5py.h5i.DATASET:
                    _check_dataset(oid.get_create_plist(), what, path, check, error)
        except HpcparError as err:
            problems.append(str(err))
            return 1  # stops the visit (an exception must not cross HDF5's callback: h5py then fails)
        except (OSError, KeyError, ValueError, RuntimeError, TypeError) as err:
            problems.append(f"{what}: corrupt: its HDF5 structure is unreadable at /{path} "
                            f"({' '.join(str(err).split())})")
            return 1
        return None

    try:
        f.id.links.visit(visit, info=True)
    except (OSError, KeyError, ValueError, RuntimeError, TypeError) as err:
        raise error(f"{what}: corrupt: its HDF5 structure is unreadable ({' '.join(str(err).split())})") from None
    if problems:
        raise error(problems[0])


def _check_dataset(dcpl, what: str, path: str, check, error: type[HpcparError]) -> None:
    """Dataset `path` of the file `what`: raw data in external files is refused; a virtual dataset's
    source files are `check`ed."""
    import h5py

    if dcpl.get_external_count():
        names = [dcpl.get_external(i)[0].decode(errors="replace") for i in range(dcpl.get_external_count())]
        raise error(f"{what}: dataset /{path} keeps its data in external files ({', '.join(map(repr, names[:3]))}), "
                    "which hpcpar never reads; the file was crafted or damaged")
    if dcpl.get_layout() == h5py.h5d.VIRTUAL:
        for i in range(dcpl.get_virtual_count()):
            source = dcpl.get_virtual_filename(i)
            if source != ".":  # "." is this file
                check(source, f"virtual dataset /{path} source")


def read_text(path: str, limit: int, what: str, error: type[HpcparError] = DataError) -> str:
    """The UTF-8 text of `path`, refused when larger than `limit` bytes (checked before reading).
    `what` names the kind of file ("tokenizer", "manifest"); OSError and bad UTF-8 become `error`."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise error(f"{path}: {size} bytes, more than any {what} hpcpar reads ({limit // MiB} MiB); "
                            "the file is not one, or was crafted")
            raw = f.read(limit + 1)
    except OSError as err:
        raise error(f"cannot read {what} {path}: {err.strerror or err}") from None
    if len(raw) > limit:  # grew while read (or a device): never more than the limit
        raise error(f"{path}: more than {limit // MiB} MiB, more than any {what} hpcpar reads")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{path}: not a {what} (not UTF-8 text at byte {err.start})") from None


def parse_json(text: str, where: str, what: str, error: type[HpcparError] = DataError):
    """`json.loads(text)`, with a syntax error or nesting too deep for the parser as `error`."""
    try:
        return json.loads(text)
    except ValueError as err:
        raise error(f"{where}: not a valid {what} (not JSON: {err})") from None
    except RecursionError:
        raise error(f"{where}: not a valid {what} (JSON nested too deep)") from None


def read_json(path: str, limit: int, what: str, error: type[HpcparError] = DataError):
    """The JSON value in `path` (at most `limit` bytes; see `read_text` and `parse_json`)."""
    return parse_json(read_text(path, limit, what, error), path, what, error)


def exact_int(value) -> bool:
    """A JSON integer (not a bool, not a float)."""
    return isinstance(value, int) and not isinstance(value, bool)
