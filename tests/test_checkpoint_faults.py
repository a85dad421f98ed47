"""Checkpoints that fail or are damaged (issue 27, items 5-7), met as a user meets them: real 2-rank ``lsd-train`` jobs
(Lightning's subprocess launcher, Gloo), each bounded in time and checked for its exit code, its one line per rank and
what is left on disk.

- a save that fails in the OS (a full disk, a file-size limit, no permission), full and sharded: every rank names the
  file and the error, exit 1, the previous checkpoint intact and alone;
- a save that crashed between its two renames: ``ckpt_path=last`` resumes from the ``.old`` it left;
- a damaged or foreign checkpoint on resume: every rank names the file and what is wrong, exit 1, no traceback;
- a planted pickle (a ``__reduce__`` that writes a marker file) in a sharded checkpoint: it does not run, through
  ``Trainer.fit(ckpt_path=...)`` nor through ``lsd-consolidate``.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import subprocess
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import fresh_job_env
from _mesh_fit import fit, static
from tests.processes.test_faults import ROOT, failure_lines, lsd_train
from tests.test_resume import summaries

from lightning_static_dist.checkpoint import check_lightning_checkpoint, consolidate, is_sharded_checkpoint

pytestmark = pytest.mark.multiprocess

SHARDED = ("strategy.mesh.dp_replicate=1", "strategy.mesh.dp_shard=2")  # reduce_scatter: sharded checkpoints


def saved_step(path: str) -> int:
    """The global step of the checkpoint at ``path`` (a file, or a sharded directory read on one process)."""
    if is_sharded_checkpoint(path):
        out = f"{path}.consolidated"
        consolidate(path, out)
        path = out
    return torch.load(path, weights_only=True)["global_step"]


def assert_every_rank_says(err: str, *parts: str) -> list[str]:
    """One failure line from each of the 2 ranks, each holding every one of ``parts``; and no traceback."""
    lines = failure_lines(err)
    assert sorted(line.split(":")[1] for line in lines) == [" rank 0", " rank 1"], err[-4000:]
    for line in lines:
        assert all(part in line for part in parts), (parts, line)
    assert "Traceback" not in err, err[-4000:]
    return lines


# ------------------------------------------------------------------------------------------ a save that fails


@pytest.mark.parametrize(("how", "rank", "fmt", "error"), [
    ("efbig", 0, (), "[Errno 27] File too large"),
    pytest.param("enospc", 0, (), "[Errno 28] No space left on device", marks=pytest.mark.slow),  # efbig's path
    ("eacces", 0, (), "[Errno 13] Permission denied"),
    ("efbig", 1, SHARDED, "[Errno 27] File too large"),
], ids=["full-efbig", "full-enospc", "full-eacces", "sharded-efbig"])
def test_a_save_that_fails_ends_every_rank_with_one_line_and_keeps_the_previous_checkpoint(
    tmp_path: Path, how: str, rank: int, fmt: tuple[str, ...], error: str
) -> None:
    # rank `rank`'s write of the step-4 checkpoint fails in the OS (tests/faulty.py: break_writes); the step-2 one
    # was written under the same name. Before: rank 0's error was a traceback and rank 1 waited at the save's
    # barrier until it said "rank 0 is gone"; a full disk during Lightning's move from /tmp cut the old file short
    if how == "eacces" and os.geteuid() == 0:
        pytest.skip("root writes into a read-only folder: the other two cases fail a write for root too")
    code, err, seconds = lsd_train(tmp_path, "model.fault=save_fails", f"model.save_error={how}",
                                   f"model.fault_rank={rank}", "model.fault_step=4", "model.save_every=2", *fmt)
    directory = tmp_path / "ckpt"
    os.chmod(directory, 0o755)
    assert code == 1, err[-4000:]
    assert_every_rank_says(err, f"could not write the checkpoint {directory / 'last.ckpt'}: rank {rank}", error,
                           "nothing was replaced")
    assert os.listdir(directory) == ["last.ckpt"]  # alone: no .tmp, no .old
    assert is_sharded_checkpoint(str(directory / "last.ckpt")) == bool(fmt)
    assert saved_step(str(directory / "last.ckpt")) == 2  # intact
    assert seconds < 60


def test_a_consolidation_at_the_end_that_fails_ends_every_rank_with_one_line_and_keeps_the_sharded_one(
    tmp_path: Path,
) -> None:
    # strategy.checkpoint.consolidate_at_end: rank 0 turns the last sharded checkpoint into a file after training;
    # before, its write failing was rank 0's traceback, rank 1's "rank 0 is gone" after the barrier, and a .tmp left
    code, err, seconds = lsd_train(tmp_path, "model.fault=save_fails_at_end", "model.save_error=efbig",
                                   "model.fault_rank=0", "trainer.max_steps=4", "model.save_every=4", *SHARDED)
    directory = tmp_path / "ckpt"
    assert code == 1, err[-4000:]
    assert_every_rank_says(err, f"could not write the checkpoint {directory / 'last.ckpt'}: rank 0",
                           "[Errno 27] File too large")
    assert os.listdir(directory) == ["last.ckpt"]
    assert is_sharded_checkpoint(str(directory / "last.ckpt")) and saved_step(str(directory / "last.ckpt")) == 4
    assert seconds < 60


# ------------------------------------------------------------------------- a crash between the two renames


def test_ckpt_path_last_resumes_from_the_old_checkpoint_a_crash_between_the_renames_left(tmp_path: Path) -> None:
    from lightning_static_dist.checkpoint import partial_file

    # a save of `x.ckpt` that crashed between its renames leaves the previous checkpoint as `x.ckpt.old` and the new
    # one, not known to be whole, as its partial file (made here as such a crash leaves them: no hook stops a process
    # between two renames); before, ckpt_path=last saw no checkpoint there and started again from step 0
    code, err, _ = lsd_train(tmp_path, "trainer.max_steps=4", "model.save_every=4")
    assert code == 0, err[-4000:]
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    os.replace(ckpt, f"{ckpt}.old")
    Path(partial_file(str(ckpt))).write_bytes(b"half a checkpoint")
    code, err, _ = lsd_train(tmp_path, "trainer.max_steps=8", "model.save_every=4", "ckpt_path=last")
    assert code == 0, err[-4000:]
    assert f"lsd-train: ckpt_path=last: resuming from {ckpt}.old" in err, err[-4000:]
    assert [(s["steps"], s["batches"]) for s in summaries(tmp_path)] == [(4, 4), (8, 4)]  # it went on from step 4
    assert os.listdir(ckpt.parent) == ["last.ckpt"]  # the next save of the name put its own in place, and no more
    assert saved_step(str(ckpt)) == 8


# ------------------------------------------------------------------------------ a damaged checkpoint on resume


_SAVED_FORMATS = {  # name: the overrides of the run that writes it
    "full": (),
    "sharded": (*SHARDED, "strategy.checkpoint.consolidate_at_end=false"),
    "simulated": (*SHARDED, "strategy.checkpoint.consolidate_at_end=false", "strategy.simulate.world_size=4",
                  "trainer.devices=1", "strategy.mesh.dp_shard=4"),
}


class _Saved:
    """Checkpoints of the tiny model at step 4, each written by one ``lsd-train`` run the first time a case asks for
    it: full, sharded (kept sharded: no consolidation at the end), and sharded in a simulated world of 4 ranks (one
    process: only rank 0's pieces)."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self._factory = factory
        self._made: dict[str, Path] = {}

    def __getitem__(self, name: str) -> Path:
        if name not in self._made:
            root = self._factory.mktemp(name)
            code, err, _ = lsd_train(root, "trainer.max_steps=4", "model.save_every=4", *_SAVED_FORMATS[name])
            assert code == 0, err[-4000:]
            self._made[name] = root / "ckpt" / "last.ckpt"
        return self._made[name]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> _Saved:
    return _Saved(tmp_path_factory)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGES = {  # name: (the checkpoint it starts from, what is done to it, the resuming run's overrides, the words)
    "truncated": ("full", _truncate, (), "not a whole checkpoint file (truncated, or not written by torch.save)"),
    "another-model": ("full", lambda path: None, ("model.n_embd=48",), "another model's checkpoint"),
    "no-distcp": ("sharded", lambda path: (path / "__1_0.distcp").unlink(), SHARDED,
                  "a file of the checkpoint is missing: [Errno 2] No such file or directory"),
    "no-metadata": ("sharded", lambda path: (path / ".metadata").unlink(), SHARDED,
                    "a file of the checkpoint is missing: [Errno 2] No such file or directory"),
    # resharding reads every rank's pieces, but a simulated world of 4 wrote only rank 0's
    "simulated-world-of-4": ("simulated", lambda path: None, SHARDED, "from a world whose ranks did not all write"),
}


# the default run keeps each kind of damage's words (torch's, load_state_dict's, DCP's); `-m slow` adds a second
# missing file
_DAMAGES_KEPT = ("truncated", "another-model", "no-distcp", "simulated-world-of-4")


@pytest.mark.parametrize("damage", [d if d in _DAMAGES_KEPT else pytest.param(d, marks=pytest.mark.slow)
                                    for d in DAMAGES])
def test_a_damaged_checkpoint_ends_every_rank_with_one_line_naming_it(tmp_path: Path, saved: _Saved,
                                                                      damage: str) -> None:
    # before: a traceback (torch's, DCP's or load_state_dict's) on each rank, DCP's as a BaseException past
    # lsd-train's handler
    source, spoil, overrides, words = DAMAGES[damage]
    ckpt = tmp_path / "damaged.ckpt"
    (shutil.copytree if saved[source].is_dir() else shutil.copy)(saved[source], ckpt)
    spoil(ckpt)
    code, err, seconds = lsd_train(tmp_path, f"ckpt_path={ckpt}", *overrides)
    assert code == 1, err[-4000:]
    assert_every_rank_says(err, f"cannot resume from {ckpt}: ", words)
    assert seconds < 30


NOT_LIGHTNING = {  # name: (what the torch file holds, the words; issue 37: Lightning's KeyError or AttributeError)
    "a-tensor": (lambda: torch.ones(3), "not a Lightning checkpoint: it holds a Tensor"),
    "a-dict": (lambda: {"weights": torch.ones(2)},
               "not a Lightning checkpoint: a dictionary without 'pytorch-lightning_version' and 'state_dict' (its"
               " keys: 'weights')"),
    "a-state-dict-only": (lambda: {"state_dict": {"w": torch.ones(1)}}, "not a Lightning checkpoint: a dictionary"
                                                                        " without 'pytorch-lightning_version'"),
}


def test_each_torch_file_that_is_not_a_lightning_checkpoint_is_named_for_what_it_holds() -> None:
    # the words of every case below, without a job (the default run starts one job, for a tensor)
    for make, words in NOT_LIGHTNING.values():
        with pytest.raises(Exception, match=re.escape(words)):
            check_lightning_checkpoint(make())


@pytest.mark.parametrize("held", [h if h == "a-tensor" else pytest.param(h, marks=pytest.mark.slow)
                                  for h in NOT_LIGHTNING])
def test_a_torch_file_that_is_not_a_lightning_checkpoint_ends_every_rank_with_one_line(tmp_path: Path,
                                                                                      held: str) -> None:
    # before: KeyError 'pytorch-lightning_version' (a 27-line traceback per rank), "'Tensor' object has no
    # attribute 'pop'", or KeyError 'state_dict'
    make, words = NOT_LIGHTNING[held]
    path = tmp_path / "weights.pt"
    torch.save(make(), path)
    code, err, seconds = lsd_train(tmp_path, f"ckpt_path={path}")
    assert code == 1, err[-4000:]
    assert_every_rank_says(err, f"cannot resume from {path}: rank 0: {words}")
    assert seconds < 30


def test_the_next_start_removes_what_interrupted_saves_left_and_says_so(tmp_path: Path) -> None:
    # issue 37: a kill during a save left its partial file, a sharded save's .tmp folder and an old copy beside its
    # replacement on disk until a later save of the same name. The old copy a crash between the two renames leaves
    # alone is the checkpoint itself (ckpt_path=last resumes from it): it stays
    from lightning_static_dist.checkpoint import partial_file

    folder = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    (folder / "epoch=0-step=4.ckpt.tmp").mkdir(parents=True)
    (folder / "epoch=0-step=4.ckpt.tmp" / "__0_0.distcp").write_bytes(b"half")
    leftovers = [Path(partial_file(str(folder / "last.ckpt"))), folder / "last.ckpt.old",
                 folder / "epoch=0-step=4.ckpt.tmp"]
    for path in (folder / "last.ckpt", *leftovers[:2], tmp_path / "ckpt" / "alone.ckpt.old"):
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"a checkpoint")
    code, err, _ = lsd_train(tmp_path, "trainer.max_steps=2")
    assert code == 0, err[-4000:]
    (line,) = [line for line in err.splitlines() if line.startswith("lsd-train: removed ")]
    assert line == ("lsd-train: removed what interrupted saves left (3 paths): "
                    + ", ".join(str(path) for path in sorted(leftovers, key=lambda p: p.name))), line
    assert not any(path.exists() for path in leftovers)
    assert (folder / "last.ckpt").exists() and (tmp_path / "ckpt" / "alone.ckpt.old").exists()


# ------------------------------------------------------------------------------------------ untrusted input


class _Planted:
    """Unpickled, it opens ``marker`` for writing: the file appears. What a hostile checkpoint would run instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (open, (str(self.marker), "w"))


def _plant(ckpt: Path, where: str, marker: Path) -> None:
    """Replace the sharded checkpoint's ``lightning_meta.pt`` (``meta``) or DCP's ``.metadata`` (``index``) with a
    pickle that writes ``marker``, and check that it would, loaded as torch and DCP used to load them."""
    if where == "meta":
        torch.save({"lightning": {}, "x": _Planted(marker)}, ckpt / "lightning_meta.pt")
        torch.load(ckpt / "lightning_meta.pt", weights_only=False)
    else:
        (ckpt / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
        pickle.loads((ckpt / ".metadata").read_bytes())
    assert marker.exists()  # the plant works
    marker.unlink()


@pytest.mark.parametrize("where", ["meta", "index"])
def test_a_planted_pickle_in_a_sharded_checkpoint_does_not_run_on_resume(tmp_path: Path, saved: _Saved,
                                                                         where: str) -> None:
    # lsd-train resumes through Trainer.fit(ckpt_path=...): the strategy read lightning_meta.pt with
    # weights_only=False and DCP reads .metadata with pickle.load; either ran the planted code on every rank
    ckpt, marker = tmp_path / "planted.ckpt", tmp_path / "marker"
    shutil.copytree(saved["sharded"], ckpt)
    _plant(ckpt, where, marker)
    code, err, seconds = lsd_train(tmp_path, f"ckpt_path={ckpt}", *SHARDED)
    assert not marker.exists()
    assert code == 1, err[-4000:]
    refused = "weights-only load refuses" if where == "meta" else "none of the classes a checkpoint's index holds"
    assert_every_rank_says(err, f"cannot resume from {ckpt}: ", refused)
    assert seconds < 30


@pytest.mark.parametrize("where", ["meta", "index"])
def test_a_planted_pickle_does_not_run_in_lsd_consolidate(tmp_path: Path, saved: _Saved, where: str) -> None:
    ckpt, marker = tmp_path / "planted.ckpt", tmp_path / "marker"
    shutil.copytree(saved["sharded"], ckpt)
    _plant(ckpt, where, marker)
    lsd_consolidate = os.path.join(os.path.dirname(sys.executable), "lsd-consolidate")
    done = subprocess.run([lsd_consolidate, str(ckpt), str(tmp_path / "out.ckpt")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=fresh_job_env())
    assert not marker.exists()
    assert done.returncode == 1, done.stderr[-4000:]
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"lsd-consolidate: cannot consolidate {ckpt}: "), line
    assert not (tmp_path / "out.ckpt").exists()


def test_the_callers_weights_only_reaches_a_sharded_checkpoint(tmp_path: Path) -> None:
    # Trainer.fit(weights_only=...) went nowhere with a sharded checkpoint (its lightning_meta.pt was always read
    # with weights_only=False): now None means torch's weights-only load, and False, the caller's trust, is honoured
    fit(str(tmp_path / "two"), 2, static(1, 2, checkpoint={"consolidate_at_end": False}), steps=2, save_at=2)
    ckpt = tmp_path / "two" / "stepstep=2.ckpt"
    meta = torch.load(ckpt / "lightning_meta.pt", weights_only=True)
    meta["lightning"]["hyper_parameters"]["ratio"] = Fraction(1, 3)  # a class torch's weights-only load refuses
    torch.save(meta, ckpt / "lightning_meta.pt")
    with pytest.raises(Exception, match=r"weights-only load refuses .* GLOBAL fractions.Fraction"):
        fit(str(tmp_path / "untrusted"), 2, static(1, 2), steps=3, ckpt_path=str(ckpt))
    fit(str(tmp_path / "trusted"), 2, static(1, 2), steps=3, ckpt_path=str(ckpt), weights_only=False)


def test_an_old_folder_beside_a_consolidated_file_of_its_name_is_not_resumed(tmp_path: Path) -> None:
    # the consolidation at the end of fit turns the sharded folder `last.ckpt` into a file; a kill while it removes
    # the moved-aside `last.ckpt.old/` leaves that folder, newer than the file: `last` must still take the file
    from lightning_static_dist.cli import find_last_checkpoint

    (tmp_path / "last.ckpt").write_bytes(b"the consolidated file")
    (tmp_path / "last.ckpt.old").mkdir()
    os.utime(tmp_path / "last.ckpt", (1, 1))
    assert find_last_checkpoint([str(tmp_path)]) == str(tmp_path / "last.ckpt")


def test_lsd_consolidate_does_not_replace_a_folder_given_as_out(tmp_path: Path) -> None:
    # `lsd-consolidate DIR exports/` would have moved the folder aside and removed it, with what it held
    from lightning_static_dist.checkpoint import META_FILE
    from lightning_static_dist.cli import consolidate_main

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / META_FILE).write_bytes(b"")
    (tmp_path / "exports").mkdir()
    (tmp_path / "exports" / "precious.txt").write_text("keep me")
    with pytest.raises(SystemExit) as stopped:
        consolidate_main([str(tmp_path / "ckpt"), str(tmp_path / "exports")])
    assert stopped.value.code == 2
    assert (tmp_path / "exports" / "precious.txt").read_text() == "keep me"
