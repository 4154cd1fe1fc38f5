"""Checkpoints from elsewhere: containment of every name they give, and every checkpoint reader fuzzed.

The crafted-path checkpoint of issue 47 (a manifest naming ../../secret.h5, its sha256 recomputed
as anyone can) is refused without the outside file being opened; so are absolute names, links
that lead out, a `latest` pointer that leads out, HDF5 external links, virtual-dataset sources and
external raw-data files. Then `load`, `verify` and `export` (which sizes its arrays from the table)
run on mutations of a valid checkpoint (`fuzzing.py`: byte flips, truncations, appended bytes,
manifest fields replaced, size lies) of both storages: per-rank files (manifest, index, rank file)
and the shared file (manifest, index.h5 holding the data). Corruption (the manifest's sha256 left
as it was) must load the same numbers or be refused in one line; a crafted file (the digests
recomputed) may also load other, self-consistent numbers, but never raise anything else, hang,
or write outside the test's directory. A sample goes through `hpcpar ckpt verify` in a subprocess:
exit 2, one line, no traceback.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest

from fuzzing import ROUNDS, Outcomes, byte_mutation, json_mutation, json_text, rng, watched
from hpcpar.checkpoint import tools
from hpcpar.checkpoint.directory import latest
from hpcpar.checkpoint.format import (CRC_ATTR, FORMAT, FORMAT_VERSION, INDEX, LIBVER, MANIFEST, SHARED, attrs_digest,
                                      chunk_shape, crc32, fixed_string, manifest_digest)
from hpcpar.checkpoint.load import load
from hpcpar.checkpoint.save import _tensor_table, save
from hpcpar.checkpoint.writers import assign_writers, in_shared_file
from hpcpar.errors import CheckpointError
from hpcpar.layout import Layout
from hpcpar.runtime.solo import SoloCommunicator

REPO = pathlib.Path(__file__).resolve().parents[2]
COMM = SoloCommunicator()
META = {"note": "fuzz", "count": 12345}


def tensors() -> dict[str, np.ndarray]:
    gen = np.random.default_rng(47)
    return {"model/w": gen.standard_normal((24, 10)), "model/b": gen.standard_normal(10).astype(np.float32),
            "optim/count": np.array(11, dtype=np.int64), "optim/empty": np.zeros((0, 3))}


def per_rank_checkpoint(directory: pathlib.Path) -> str:
    return save(str(directory), 4, {n: (a, Layout.replicated(a.shape)) for n, a in tensors().items()}, META, COMM)


def shared_checkpoint(directory: pathlib.Path) -> str:
    """A shared-storage checkpoint as `writers.write_shared` writes it (same attributes, chunks,
    fletcher32, crc32s and manifest), through serial h5py: no parallel HDF5 needed to read one."""
    arrays = tensors()
    ckpt = directory / "step-0000004"
    ckpt.mkdir(parents=True)
    held = {n: (a.shape, a.dtype.str, [tuple((0, k) for k in a.shape)]) for n, a in arrays.items()}
    assignment = in_shared_file(assign_writers([held]))
    meta = dict(META, step=4, format_version=FORMAT_VERSION)
    meta_json, attrs = json.dumps(meta), {}
    with h5py.File(ckpt / INDEX, "w", libver=LIBVER) as f:
        f.attrs["format"], f.attrs["format_version"] = fixed_string(FORMAT), FORMAT_VERSION
        f.attrs["storage"], f.attrs["meta"] = fixed_string(SHARED), fixed_string(meta_json)
        for name, t in assignment.items():
            chunks = chunk_shape(t.shape, np.dtype(t.dtype).itemsize)
            ds = f.create_dataset(name, data=arrays[name], chunks=chunks, fletcher32=chunks is not None)
            attrs[name] = (t.dtype, json.dumps([b.to_json() for b in t.blocks]))
            ds.attrs["global_shape"] = np.asarray(t.shape, dtype=np.int64)
            ds.attrs["dtype"], ds.attrs["sharding"] = (fixed_string(v) for v in attrs[name])
            if chunks is None:
                ds.attrs[CRC_ATTR] = crc32(arrays[name])
    files = {INDEX: {"size": os.path.getsize(ckpt / INDEX), "attrs_sha256": attrs_digest(meta_json, attrs)}}
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "storage": SHARED, "meta": meta,
                "files": files, "tensors": _tensor_table(assignment, {})}
    write_manifest(str(ckpt), manifest)
    return str(ckpt)


def read_manifest_json(ckpt: str) -> dict:
    with open(os.path.join(ckpt, MANIFEST)) as f:
        return json.load(f)


def write_manifest(ckpt: str, manifest, digest: bool = True) -> None:
    """The manifest, with its sha256 recomputed (as whoever crafts one does) when `digest`."""
    if digest and isinstance(manifest, dict):
        manifest = {k: v for k, v in manifest.items() if k != "sha256"}
        manifest["sha256"] = manifest_digest(manifest)
    with open(os.path.join(ckpt, MANIFEST), "w") as f:
        f.write(json_text(manifest))


def wanted() -> dict:
    return {n: Layout.replicated(a.shape) for n, a in tensors().items()}


def same_load(result) -> bool:
    got, meta = result
    return all(got[n].dtype == a.dtype and np.array_equal(got[n], a) for n, a in tensors().items()) and \
        meta.get("count") == META["count"] and meta.get("step") == 4


def verified(path: str) -> list:
    """`verify` as `hpcpar ckpt verify` reports it: the problems in one CheckpointError."""
    problems = tools.verify(path)
    if problems:
        raise CheckpointError("; ".join(problems))
    return problems


def exported(path: str, out: str) -> dict:
    """`ckpt export`: every tensor of the table, at the shape the table gives (the table-driven allocation)."""
    tools.export(path, out)
    with np.load(out) as z:
        return {k: z[k] for k in z.files}


def same_export(got: dict) -> bool:
    return sorted(got) == sorted(tensors()) and all(
        got[n].dtype == a.dtype and np.array_equal(got[n], a) for n, a in tensors().items())


# ------------------------------------------------------------------------------ containment


def crafted(tmp_path: pathlib.Path, name: str) -> tuple[str, str]:
    """Issue 47's checkpoint: its manifest names `name` for the rank file (sha256 recomputed); the outside
    file is a copy of the real rank file, a valid HDF5 file that would load as the tensors."""
    ckpt = per_rank_checkpoint(tmp_path / "run")
    secret = tmp_path / "secret.h5"
    shutil.copy(os.path.join(ckpt, "rank-00000.h5"), secret)
    manifest = read_manifest_json(ckpt)
    for t in manifest["tensors"].values():
        for b in t["blocks"]:
            b["file"] = name
    manifest["files"][name] = manifest["files"].pop("rank-00000.h5")
    write_manifest(ckpt, manifest)
    return ckpt, str(secret)


@pytest.mark.parametrize("name", ["../../secret.h5", "ABSOLUTE"])
def test_a_manifest_naming_a_file_outside_is_refused_without_opening_it(tmp_path, monkeypatch, name):
    name = str(tmp_path / "secret.h5") if name == "ABSOLUTE" else name
    ckpt, secret = crafted(tmp_path, name)
    opened = []
    real_file = h5py.File

    def guarded(path, *args, **kwargs):  # HDF5 opens files in C, unseen by the audit hook
        if isinstance(path, (str, os.PathLike)) and os.path.realpath(path) == os.path.realpath(secret):
            opened.append(path)
        return real_file(path, *args, **kwargs)

    monkeypatch.setattr(h5py, "File", guarded)
    with watched(str(tmp_path), forbidden=(secret,)) as seen:
        with pytest.raises(CheckpointError) as err:
            load(ckpt, wanted(), COMM)
        problems = tools.verify(ckpt)
        with pytest.raises(CheckpointError):
            tools.info(ckpt)
        with pytest.raises(CheckpointError):
            tools.export(ckpt, str(tmp_path / "all.npz"))
    assert not opened and not seen, (opened, seen)
    text = str(err.value)
    assert text == problems[0] and len(problems) == 1 and "\n" not in text
    assert text.startswith(os.path.join(ckpt, MANIFEST)) and repr(name) in text and "leads outside" in text


def test_links_that_lead_out_are_refused(tmp_path):
    ckpt = per_rank_checkpoint(tmp_path / "run")
    outside = tmp_path / "elsewhere.h5"
    os.replace(os.path.join(ckpt, "rank-00000.h5"), outside)
    os.symlink(outside, os.path.join(ckpt, "rank-00000.h5"))
    with pytest.raises(CheckpointError, match="rank-00000.h5' is a symbolic link that leads outside"):
        load(ckpt, wanted(), COMM)
    assert "symbolic link that leads outside" in tools.verify(ckpt)[0]
    # A link that stays inside (a checkpoint reached through a linked directory) is fine.
    os.replace(outside, os.path.join(ckpt, "rank-00000.h5"))
    os.symlink(ckpt, tmp_path / "linked")
    assert same_load(load(str(tmp_path / "linked"), wanted(), COMM))


def test_a_latest_pointer_that_leads_out_is_refused(tmp_path):
    run = tmp_path / "run"
    ckpt = per_rank_checkpoint(run)
    assert latest(str(run)) == ckpt
    (run / "latest").write_text("../../elsewhere\n")
    with pytest.raises(CheckpointError, match=r"latest: checkpoint '../../elsewhere' leads outside"):
        latest(str(run))
    (run / "latest").write_text("step-0000009\n")          # a step directory that is a link to elsewhere
    shutil.copytree(ckpt, tmp_path / "other")
    os.symlink(tmp_path / "other", run / "step-0000009")
    with pytest.raises(CheckpointError, match="step-0000009' is a symbolic link that leads outside"):
        load(str(run), wanted(), COMM)
    (run / "latest").write_text("x" * 5000)
    with pytest.raises(CheckpointError, match="not a checkpoint pointer"):
        latest(str(run))


def rewrite_index(ckpt: str, change) -> None:
    """Change index.h5 with `change(h5py.File)`, then the manifest's record of it (size, sha256)."""
    with h5py.File(os.path.join(ckpt, INDEX), "r+") as f:
        change(f)
    manifest = read_manifest_json(ckpt)
    with open(os.path.join(ckpt, INDEX), "rb") as f:
        data = f.read()
    manifest["files"][INDEX].update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    write_manifest(ckpt, manifest)


def test_hdf5_links_and_sources_outside_are_refused(tmp_path):
    ckpt = per_rank_checkpoint(tmp_path / "run")
    shutil.copy(os.path.join(ckpt, "rank-00000.h5"), tmp_path / "outside.h5")

    def vds_outside(f):
        layout = h5py.VirtualLayout(shape=(24, 10), dtype="<f8")
        layout[...] = h5py.VirtualSource("../../outside.h5", "model/w/block-0", shape=(24, 10))
        attrs = dict(f["model/w"].attrs)
        del f["model/w"]
        ds = f["model"].create_virtual_dataset("w", layout)
        ds.attrs.update(attrs)

    rewrite_index(ckpt, vds_outside)
    with h5py.File(os.path.join(ckpt, INDEX), "r") as f:   # HDF5 itself would follow it: the refusal matters
        assert np.array_equal(f["model/w"][()], tensors()["model/w"])
    problems = tools.verify(ckpt)
    assert len(problems) == 1 and "virtual dataset /model/w source '../../outside.h5' leads outside" in problems[0]
    assert same_load(load(ckpt, wanted(), COMM))   # load reads the rank files itself, never through the index

    shared = shared_checkpoint(tmp_path / "shared")

    def external_link(f):
        del f["model/b"]
        f["model/b"] = h5py.ExternalLink(str(tmp_path / "outside.h5"), "/model/b/block-0")

    with h5py.File(os.path.join(shared, INDEX), "r+") as f:
        external_link(f)
    manifest = read_manifest_json(shared)
    manifest["files"][INDEX]["size"] = os.path.getsize(os.path.join(shared, INDEX))
    write_manifest(shared, manifest)
    with pytest.raises(CheckpointError, match=r"external link /model/b to '/.*outside.h5' leads outside"):
        load(shared, wanted(), COMM)
    assert "external link /model/b" in tools.verify(shared)[0]


def test_datasets_with_external_raw_data_are_refused(tmp_path):
    """A dataset whose bytes are another file's (with a crc32 that matches them, so nothing else would
    stop it): HDF5 resolves such names against the working directory, so any is refused."""
    shared = shared_checkpoint(tmp_path / "shared")
    b = tensors()["model/b"]
    (tmp_path / "raw.bin").write_bytes(b.tobytes())
    with h5py.File(os.path.join(shared, INDEX), "r+") as f:
        attrs = dict(f["model/b"].attrs)
        del f["model/b"]
        ds = f.create_dataset("model/b", shape=b.shape, dtype=b.dtype, external=[(str(tmp_path / "raw.bin"), 0, 40)])
        ds.attrs.update(attrs, **{CRC_ATTR: crc32(b)})
        assert np.array_equal(ds[()], b)                  # HDF5 reads the outside file as the tensor
    manifest = read_manifest_json(shared)
    manifest["files"][INDEX]["size"] = os.path.getsize(os.path.join(shared, INDEX))
    write_manifest(shared, manifest)
    with pytest.raises(CheckpointError, match=r"dataset /model/b keeps its data in external files \('/"):
        load(shared, wanted(), COMM)


def test_a_table_that_claims_more_than_its_files_hold_is_refused(tmp_path):
    ckpt = per_rank_checkpoint(tmp_path / "run")
    manifest = read_manifest_json(ckpt)
    manifest["tensors"]["model/w"]["shape"] = [24, 10**12]
    manifest["tensors"]["model/w"]["blocks"][0]["region"] = [[0, 24], [0, 10**12]]
    write_manifest(ckpt, manifest)
    with pytest.raises(CheckpointError, match=r"claim \d+ bytes in rank-00000.h5, which holds \d+"):
        tools.export(ckpt, str(tmp_path / "all.npz"))
    manifest["tensors"]["model/w"]["dtype"] = "|O"
    write_manifest(ckpt, manifest)
    with pytest.raises(CheckpointError, match=r"tensor model/w: dtype '\|O' is not a plain numeric dtype"):
        load(ckpt, wanted(), COMM)
    manifest["tensors"]["model/w\nhpcpar: error: a second line"] = manifest["tensors"].pop("model/w")
    write_manifest(ckpt, manifest)
    problems = tools.verify(ckpt)           # a name from the file is quoted, the refusal stays one line
    assert len(problems) == 1 and "\n" not in problems[0] and "model/w\\nhpcpar: error" in problems[0]


# ------------------------------------------------------------------------------ fuzzing


class Target:
    """A checkpoint whose files are mutated one at a time, restored after each case, and the three
    readers run on it: load (with the saved layouts), verify, export (the table's shapes)."""

    def __init__(self, ckpt: str, tmp: pathlib.Path, storage: str):
        self.ckpt, self.tmp = ckpt, tmp
        self.files = {name: pathlib.Path(ckpt, name).read_bytes() for name in os.listdir(ckpt)}
        self.out = {kind: Outcomes(f"checkpoint {storage} {kind}", CheckpointError, other_allowed=True,
                                   root=str(tmp)) for kind in ("load", "verify", "export")}

    def restore(self) -> None:
        for name, data in self.files.items():
            pathlib.Path(self.ckpt, name).write_bytes(data)

    def case(self, label: str, kind: str, crafted: bool) -> None:
        """Run the readers on the checkpoint as it is now. Corruption (`crafted` False) must load the
        same or be refused, and verify must find what load refuses."""
        out = str(self.tmp / "all.npz")
        results = {}
        for reader, call, same in (("load", lambda: load(self.ckpt, wanted(), COMM), same_load),
                                   ("verify", lambda: verified(self.ckpt), lambda problems: True),
                                   ("export", lambda: exported(self.ckpt, out), same_export)):
            results[reader] = self.out[reader].run(f"{label} ({kind})", kind, call, same)
            if not crafted:
                assert results[reader] != "other", f"{label}: corruption loaded other numbers ({reader})"
        if not crafted and results["load"] == "refused":
            assert results["verify"] == "refused", f"{label}: load refuses, verify finds nothing"
        self.restore()

    def report(self) -> list[str]:
        return [o.report() for o in self.out.values()]


def fuzz(target: Target, gen: np.random.Generator, count: int) -> None:
    """`count` mutations of each of the checkpoint's files (corrupt and crafted)."""
    manifest = json.loads(target.files[MANIFEST])
    for k in range(count):
        for name in sorted(target.files):
            label, data = byte_mutation(target.files[name], gen)
            pathlib.Path(target.ckpt, name).write_bytes(data)
            target.case(f"{name}: {label}", "bytes", crafted=False)
            if name == MANIFEST:  # crafted manifests: fields changed, the sha256 recomputed
                for _ in range(2):
                    label, value = json_mutation(manifest, gen)
                    write_manifest(target.ckpt, value)
                    target.case(f"{name}: {label}", "field", crafted=True)
            elif k % 2 == 0:  # the same bytes, the manifest's record of the file made to match (a crafted file)
                crafted_manifest = json.loads(target.files[MANIFEST])
                entry = crafted_manifest["files"][name]
                entry["size"] = len(data)
                if "sha256" in entry:
                    entry["sha256"] = hashlib.sha256(data).hexdigest()
                write_manifest(target.ckpt, crafted_manifest)
                target.case(f"{name}: {label}, manifest updated", "crafted", crafted=True)


@pytest.mark.parametrize("storage", ["per_rank", "shared"])
def test_fuzz_checkpoint_readers(tmp_path, storage):
    ckpt = per_rank_checkpoint(tmp_path / "run") if storage == "per_rank" else shared_checkpoint(tmp_path / "run")
    target = Target(ckpt, tmp_path, storage)
    fuzz(target, rng(4700 + (storage == "shared")), 40 * ROUNDS)
    lines = target.report()
    for out in target.out.values():
        assert out.counts["refused"] > 0 and out.counts["same"] > 0, lines
    assert same_load(load(ckpt, wanted(), COMM)) and tools.verify(ckpt) == []


def test_fuzz_a_manifest_of_many_blocks(tmp_path):
    """Crafted fields in the manifest of a real 2-rank run (ZeRO-1 shards, compression residuals:
    several blocks per tensor), read by load into the table's shapes and by verify."""
    src = REPO / "tests" / "launch" / "data" / "checkpoint-031904d" / "step-0000002"
    ckpt = shutil.copytree(src, tmp_path / "step-0000002")
    manifest = read_manifest_json(str(ckpt))
    shapes = {n: tuple(t["shape"]) for n, t in manifest["tensors"].items()}
    original = load(str(ckpt), {n: Layout.replicated(s) for n, s in shapes.items()}, COMM)[0]
    out = Outcomes("checkpoint 2-rank manifest fields", CheckpointError, other_allowed=True, root=str(tmp_path))
    check = Outcomes("checkpoint 2-rank verify", CheckpointError, other_allowed=True, root=str(tmp_path))
    gen = rng(4701)

    def same(got: dict) -> bool:
        return sorted(got) == sorted(original) and all(np.array_equal(got[n], a) for n, a in original.items())

    for _ in range(60 * ROUNDS):
        label, value = json_mutation(manifest, gen)
        write_manifest(str(ckpt), value)
        out.run(label, "field", lambda: exported(str(ckpt), str(tmp_path / "all.npz")), same)
        check.run(label, "field", lambda: verified(str(ckpt)), lambda problems: True)
    out.report()
    check.report()
    write_manifest(str(ckpt), manifest)
    assert tools.verify(str(ckpt)) == [] and out.counts["refused"] > 0


def hpcpar_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "hpcpar", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=120)


def test_ckpt_verify_refuses_mutations_in_one_line(tmp_path):
    """A sample through the CLI: the crafted path, a flipped rank file, a cut manifest."""
    ckpt, _ = crafted(tmp_path / "a", "../../secret.h5")
    good = per_rank_checkpoint(tmp_path / "b")
    rank = pathlib.Path(good, "rank-00000.h5")
    data = bytearray(rank.read_bytes())
    data[read_manifest_json(good)["tensors"]["model/w"]["blocks"][0]["offset"] + 100] ^= 0x40   # in model/w's bytes
    rank.write_bytes(bytes(data))
    cut = per_rank_checkpoint(tmp_path / "c")
    pathlib.Path(cut, MANIFEST).write_bytes(pathlib.Path(cut, MANIFEST).read_bytes()[:100])
    for path, expected in ((ckpt, "leads outside"), (good, "fail their checksum"), (cut, "not JSON")):
        run = hpcpar_cli("ckpt", "verify", path)
        assert run.returncode == 2 and run.stdout == "", (path, run.stdout, run.stderr)
        assert len(run.stderr.splitlines()) == 1 and run.stderr.startswith("hpcpar: error: "), run.stderr
        assert expected in run.stderr and "Traceback" not in run.stderr, run.stderr
