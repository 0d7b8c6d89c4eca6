"""Where spawned test workers leave their results: a directory, one file per key, written atomically.

`result_dict()` used to be a dict served by a (spawned) `multiprocessing.Manager`. Every read and write of such a
proxy is a round trip to the manager process, and under load (a busy machine, a parent stuck in a long join) the
manager's connection could drop, which a test saw as an `EOFError` while its workers had done their work. A
directory needs no live process: a worker pickles (`torch.save`) each value to a temporary file and renames it into
place, so a reader sees either nothing or the whole value, however slowly anything runs.

The object is a mapping (`out[k] = v`, `out[k]`, `dict(out)`, `.items()`, `.values()`, `in`, `len`) that pickles as
its directory's path, so it goes to spawned workers as an argument the way the proxy did. Values are copies, as with
the proxy: mutate a value and store it again. The directory is removed when the creating process drops the object."""
import hashlib
import os
import pickle
import shutil
import tempfile
import weakref
from collections.abc import MutableMapping

import torch


class FileResults(MutableMapping):
    def __init__(self, root: str | None = None):
        self._owner = root is None
        self.root = root or tempfile.mkdtemp(prefix="qwen35rl-results-")
        if self._owner:
            self._cleanup = weakref.finalize(self, shutil.rmtree, self.root, True)

    def __reduce__(self):  # a worker gets the path, not the ownership
        return FileResults, (self.root,)

    def _path(self, key) -> str:
        return os.path.join(self.root, hashlib.sha1(pickle.dumps(key, protocol=4)).hexdigest() + ".pt")

    def __setitem__(self, key, value):
        fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save((key, value), f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path(key))
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def _load(self, path: str):
        return torch.load(path, weights_only=False)

    def __getitem__(self, key):
        try:
            return self._load(self._path(key))[1]
        except FileNotFoundError:
            raise KeyError(key) from None

    def __delitem__(self, key):
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            raise KeyError(key) from None

    def _files(self):
        return sorted(os.path.join(self.root, n) for n in os.listdir(self.root) if n.endswith(".pt"))

    def __iter__(self):
        return iter([self._load(p)[0] for p in self._files()])

    def __len__(self):
        return len(self._files())

    def __contains__(self, key):
        return os.path.exists(self._path(key))

    def __repr__(self):
        return f"FileResults({self.root!r})"


def result_dict() -> FileResults:
    return FileResults()
