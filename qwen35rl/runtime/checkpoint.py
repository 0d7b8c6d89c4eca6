"""Atomic checkpoints of a run: `checkpoints/step_<N>/` appears only once complete.

Layout of one checkpoint:
    step_<N>/
      model/               model + optimizer + scheduler of the train engine (torch.distributed.checkpoint, sharded)
      rng/rank_<r>.pt      python / numpy / torch (cpu + device) RNG states of each worker
      trainer_state.pt     driver state: step, data loader position, driver RNG
      meta.json            written last (temp file + fsync + rename); its presence marks a finished checkpoint.
                           It lists every other file with its size and CRC-32 (`files`), so a resume can tell a
                           truncated or missing file from an intact checkpoint (`verify`).
Everything is written into `.tmp-step_<N>-<pid>/` first and renamed into place (rename is atomic on POSIX file
systems), so a crash mid-save leaves only a temporary directory that is ignored and removed on the next start.
A `step_<N>/` that is not complete (no meta.json: copied in part, or its meta.json deleted) or not intact (a file
missing, truncated or corrupted) is never resumed from, overwritten or deleted: the resume moves every such
directory newer than the checkpoint it picks aside to `step_<N>.incomplete-<time>/` and names it, and a save that
finds one in its way does the same.
The checkpoint directory (`<run dir>/checkpoints`, or `trainer.checkpoint_dir`) must be on a file system every node
sees (DCP writes shards from every rank).
"""
from __future__ import annotations

import io
import json
import logging
import os
import random
import re
import shutil
import time
import zlib
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

STEP_DIR = re.compile(r"^step_(\d+)$")
TMP_PREFIX = ".tmp-"
INCOMPLETE = ".incomplete-"
"""`step_<N>.incomplete-<time>`: a checkpoint directory that could not be resumed from, moved aside (kept)."""
META_FILE = "meta.json"
TRAINER_STATE_FILE = "trainer_state.pt"
MODEL_DIR = "model"
RNG_DIR = "rng"
FILES_KEY = "files"
"""meta.json: relative path -> {"size": bytes, "crc32": int} of every file of the checkpoint but meta.json."""
_CHUNK = 1 << 20
NO_META = f"no {META_FILE} (a copy made in part, or its {META_FILE} deleted)"

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    pass


CHECKPOINTS = "checkpoints"
"""The run directory's own checkpoint directory (`trainer.checkpoint_dir` null)."""
_DIRS: Dict[Path, Path] = {}
"""Run directory -> its checkpoint directory, as this process's config set it (`checkpoint_dir` with a config)."""


def checkpoint_dir(run_dir: Path, cfg: Any = None) -> Path:
    """Where `run_dir`'s checkpoints are: `trainer.checkpoint_dir` (as the user wrote it, `~` expanded), else
    `<run_dir>/checkpoints`. Given a config, the answer is remembered for this process, so that the reports that know
    only the run directory (a stop, a full disk, the summary) name the same place."""
    run_dir = Path(run_dir)
    if cfg is None:
        return _DIRS.get(run_dir, run_dir / CHECKPOINTS)
    trainer = cfg["trainer"]
    configured = trainer.get("checkpoint_dir") if hasattr(trainer, "get") else None
    found = Path(str(configured)).expanduser() if configured else run_dir / CHECKPOINTS
    _DIRS[run_dir] = found
    return found


def file_list(ckpt: Path) -> Dict[str, Dict[str, int]]:
    """Size and CRC-32 (streamed, 1 MiB at a time; files in parallel threads, zlib releases the GIL) of every
    file under `ckpt` except meta.json."""
    ckpt = Path(ckpt)
    paths = [p for p in sorted(ckpt.rglob("*")) if p.is_file() and p.relative_to(ckpt).as_posix() != META_FILE]
    crcs = _crc32_all(paths)
    return {p.relative_to(ckpt).as_posix(): {"size": p.stat().st_size, "crc32": c} for p, c in zip(paths, crcs)}


def _crc32_all(paths: List[Path]) -> List[int]:
    if len(paths) <= 1:
        return [_crc32(p) for p in paths]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(8, len(paths))) as pool:
        return list(pool.map(_crc32, paths))


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                return crc
            crc = zlib.crc32(chunk, crc)


def verify(ckpt: Path) -> Optional[str]:
    """What is wrong with a finished checkpoint (one line), or None when it is intact: meta.json readable, and
    every file it lists present with its size and checksum. A checkpoint written before meta.json listed its
    files is checked for what it must hold (trainer_state.pt loads)."""
    ckpt = Path(ckpt)
    try:
        meta = read_meta(ckpt)
    except FileNotFoundError:
        return f"no {META_FILE}"
    except (OSError, ValueError) as e:
        text = (ckpt / META_FILE).read_bytes() if (ckpt / META_FILE).is_file() else b""
        return f"{META_FILE} is empty" if not text.strip() else f"{META_FILE} is not valid JSON ({e})"
    if not isinstance(meta, dict) or "step" not in meta:
        return f"{META_FILE} has no step"
    files = meta.get(FILES_KEY)
    if files is None:  # written before checkpoints listed their files
        if not (ckpt / TRAINER_STATE_FILE).is_file():
            return f"{TRAINER_STATE_FILE} is missing"
        try:
            load_trainer_state(ckpt)
        except Exception as e:  # noqa: BLE001 - any failure to unpickle is a damaged file
            return f"{TRAINER_STATE_FILE} does not load ({type(e).__name__}: {str(e)[:200]})"
        return None
    for name, want in files.items():  # sizes first: a truncated or missing file costs no reading
        path = ckpt / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != want["size"]:
            return f"{name} is {size} bytes, {want['size']} when saved (truncated or overwritten)"
    names = list(files)
    for name, crc in zip(names, _crc32_all([ckpt / n for n in names])):
        if crc != files[name]["crc32"]:
            return f"{name} does not match its checksum (corrupted)"
    return None


# ------------------------------------------------------------------------------------------------ driver side
class CheckpointManager:
    """Finds, creates, commits and prunes the checkpoints of one run directory."""

    def __init__(self, root: Path, max_keep: int = 2):
        self.root = Path(root)
        self.max_keep = max_keep

    def step_dirs(self) -> List[Path]:
        """Every `step_<N>` directory, finished or not, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            m = STEP_DIR.match(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), p))
        return [p for _, p in sorted(found)]

    def completed(self) -> List[Path]:
        """Finished checkpoints (with meta.json), oldest first."""
        return [p for p in self.step_dirs() if (p / META_FILE).is_file()]

    def set_aside(self, path: Path, why: str) -> Path:
        """Rename a checkpoint directory that cannot be resumed from to `step_<N>.incomplete-<time>` (kept on disk,
        never deleted), and say so."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        target = path.with_name(f"{path.name}{INCOMPLETE}{stamp}")
        n = 1
        while target.exists():
            n += 1
            target = path.with_name(f"{path.name}{INCOMPLETE}{stamp}-{n}")
        os.rename(path, target)
        log.warning("checkpoint %s skipped: %s; moved aside to %s (kept, not deleted)", _shown(path), why,
                    _shown(target))
        return target

    def resume_point(self) -> Optional[Path]:
        """The newest complete, intact checkpoint. Every `step_<N>` directory newer than it (no meta.json, or
        damaged: `verify`) is moved aside (`set_aside`) and named, so that no later save overwrites it."""
        for path in reversed(self.step_dirs()):
            problem = verify(path) if (path / META_FILE).is_file() else NO_META
            if problem is None:
                return path
            self.set_aside(path, problem)
        return None

    def latest(self, verified: bool = True) -> Optional[Path]:
        """The newest finished checkpoint; with `verified`, the newest intact one (a corrupt or incomplete one is
        named in the log and skipped, and kept on disk)."""
        done = self.completed()
        if not verified:
            return done[-1] if done else None
        for i in range(len(done) - 1, -1, -1):
            problem = verify(done[i])
            if problem is None:
                return done[i]
            log.error("checkpoint %s is damaged: %s; skipped (kept on disk), %s", done[i], problem,
                      f"trying {done[i - 1].name}" if i else "no older checkpoint")
        return None

    def resolve(self, resume: str) -> Optional[Path]:
        """`trainer.resume`: auto or force (the newest intact checkpoint here, or none; whether the config may resume
        it is qwen35rl.runtime.run_identity's question), never, or a checkpoint directory."""
        resume = str(resume)
        if resume == "never":
            return None
        if resume in ("auto", "force"):
            return self.resume_point()
        path = Path(resume).expanduser()
        if not (path / META_FILE).is_file():
            raise CheckpointError(f"trainer.resume={resume}: not a finished checkpoint (no {META_FILE}); expected "
                                  f"a directory like {self.root}/step_<N>")
        problem = verify(path)
        if problem:
            intact = self.latest()
            raise CheckpointError(f"trainer.resume={resume}: the checkpoint is damaged: {problem}. "
                                  + (f"The newest intact one is {intact}: trainer.resume={intact}" if intact
                                     else "No intact checkpoint in " + str(self.root)))
        return path

    def remove_partial(self) -> None:
        """Temporary directories of saves that never finished (a crash or kill during a save)."""
        if self.root.is_dir():
            for p in self.root.iterdir():
                if p.name.startswith(TMP_PREFIX) and p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)

    def begin(self, step: int) -> Path:
        tmp = self.root / f"{TMP_PREFIX}step_{step}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        return tmp

    def commit(self, tmp: Path, step: int, extra_meta: Optional[Dict[str, Any]] = None) -> Path:
        """Mark `tmp` finished and move it to step_<N> in one rename; then drop checkpoints beyond max_keep."""
        meta = {"step": step, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"), **(extra_meta or {}),
                FILES_KEY: file_list(tmp)}
        write_atomic(tmp / META_FILE, json.dumps(meta, indent=2).encode())
        final = self.root / f"step_{step}"
        if final.exists() and not (final / META_FILE).is_file():  # not a checkpoint of ours: kept, never overwritten
            self.set_aside(final, NO_META)
        if final.exists():  # the same step saved again (a run resumed from an older checkpoint): replace it
            stale = self.root / f"{TMP_PREFIX}stale-step_{step}-{os.getpid()}"
            os.rename(final, stale)
            os.rename(tmp, final)
            shutil.rmtree(stale, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(self.root)
        self.prune()
        return final

    def prune(self) -> None:
        if self.max_keep <= 0:
            return
        for old in self.completed()[:-self.max_keep]:
            shutil.rmtree(old, ignore_errors=True)


def _shown(path: Path) -> str:
    """A path as a user types it: relative to the working directory when below it."""
    p = os.path.abspath(str(path))
    rel = os.path.relpath(p)
    return p if rel.startswith("..") else rel


def write_atomic(path: Path, data: Union[bytes, str]) -> None:
    """`path` holds either its old content or all of `data` (text is written as UTF-8), never a part: temp file,
    fsync, rename. Whatever stops the write (a full disk, an interrupt) removes the temp file; an OSError is raised
    with the file named."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        if isinstance(e, OSError) and e.filename is None:
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_meta(ckpt: Path) -> Dict[str, Any]:
    return json.loads((Path(ckpt) / META_FILE).read_text())


def _save_torch(obj: Any, path: Path) -> None:
    """torch.save through memory, then one plain write: a full disk raises OSError(ENOSPC) naming the file (torch's
    own writer reports only "file write failed")."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    write_atomic(path, buf.getvalue())


def save_trainer_state(ckpt: Path, state: Dict[str, Any]) -> None:
    _save_torch(state, Path(ckpt) / TRAINER_STATE_FILE)


def load_trainer_state(ckpt: Path) -> Dict[str, Any]:
    import torch

    return torch.load(Path(ckpt) / TRAINER_STATE_FILE, weights_only=False)


# ------------------------------------------------------------------------------------------------ worker side
def rng_state(device_module: Any = None) -> Dict[str, Any]:
    import numpy as np
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if device_module is not None:
        state["device"] = device_module.get_rng_state()
    return state


def set_rng_state(state: Dict[str, Any], device_module: Any = None) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if device_module is not None and "device" in state:
        device_module.set_rng_state(state["device"])


def save_rng(ckpt: Path, rank: int, device_module: Any = None) -> None:
    (Path(ckpt) / RNG_DIR).mkdir(exist_ok=True)
    _save_torch(rng_state(device_module), Path(ckpt) / RNG_DIR / f"rank_{rank}.pt")


def load_rng(ckpt: Path, rank: int, device_module: Any = None) -> bool:
    """Restore this rank's RNG; False when the checkpoint has none for it (saved with another world size)."""
    import torch

    path = Path(ckpt) / RNG_DIR / f"rank_{rank}.pt"
    if not path.is_file():
        return False
    set_rng_state(torch.load(path, weights_only=False), device_module)
    return True


def _dcp(call: Any, what: str, *args: Any, **kwargs: Any) -> Any:
    """A DCP save or load, its failure re-raised as what it is. DCP gathers every rank's exception into a
    CheckpointException, which is a BaseException: it would pass every `except Exception` on its way up and end the
    run in a raw traceback. A stop's KeyboardInterrupt inside the write (trainer.stop_timeout_s ran out while a
    large checkpoint was being written) is raised as itself, so the run stops as stops do; anything else becomes a
    RuntimeError caused by this rank's exception (a full disk stays recognisable through the cause)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return call(*args, **kwargs)
    except CheckpointException as e:
        failures = [pair[0] for pair in e.failures.values() if pair and isinstance(pair[0], BaseException)]
        for exc in failures:
            seen = exc
            while seen is not None:
                if isinstance(seen, KeyboardInterrupt):
                    raise seen from None
                seen = seen.__cause__ or seen.__context__
        first = failures[0] if failures else None
        raise RuntimeError(f"{what} failed on rank(s) {sorted(e.failures)}: "
                           f"{type(first).__name__ if first else 'unknown'}: {first}") from first


def save_engine_state(ckpt: Path, engine: Any) -> None:
    """Collective over all ranks: each writes its shards of model + optimizer (+ scheduler) with DCP."""
    import torch.distributed.checkpoint as dcp

    _dcp(dcp.save, f"writing {Path(ckpt) / MODEL_DIR}", {"engine": engine.state_dict_for_checkpoint()},
         checkpoint_id=str(Path(ckpt) / MODEL_DIR))


def load_engine_state(ckpt: Path, engine: Any) -> None:
    """Collective: loads into the engine's current state dict in place (DCP reshards when the world changed)."""
    import torch.distributed.checkpoint as dcp

    state = {"engine": engine.state_dict_for_checkpoint()}
    _dcp(dcp.load, f"reading {Path(ckpt) / MODEL_DIR}", state, checkpoint_id=str(Path(ckpt) / MODEL_DIR))
    engine.load_checkpoint_state(state["engine"])
