"""Checkpoints: one .npz file (no pickles) holding everything a run needs to
continue exactly: config, vocabulary, weights, optimizer state, step, the
data position with its RNG state, the carried recurrent state, the corpus
fingerprint and the loss history.

Layout: "format" (a string), "meta" (a JSON string: config, vocab, step,
data position, corpus), "param/<name>", "opt/<name>" (optimizer state,
with "opt/t"), "state/<i>" (the carried (layers, B, H) arrays) and
"history/<series>". Written to a temporary file in the target's folder,
synced, then renamed over the target: a reader sees the old file or the new
one, never half of one. A temporary file that a killed process left
behind (its name holds the writer's pid) is removed by the next
remove_stale_temps() of that target.

load() trusts nothing in the file: it reads the header first, derives
from its config and vocabulary the name, dtype and shape of every array a
checkpoint of that config holds, and checks each array's own header and
byte count against them before reading any array, so that a damaged or
tampered file (a header claiming hidden_size 10**6, an array cut short,
a missing or foreign array, another dtype) is a one-line CheckpointError
naming what does not fit, never a MemoryError or a traceback.
"""
from __future__ import annotations

import json
import math
import os
import re
import socket
import tempfile
import zipfile
import zlib
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .. import cells
from .charlm import parameter_shapes
from .config import Config
from .data import Vocab

FORMAT = "halstm-charlm/1"
HISTORY = {"train_step": np.int64, "train_loss": np.float64,
           "val_step": np.int64, "val_loss": np.float64}


class CheckpointError(ValueError):
    """A file that is not a usable checkpoint, or one that does not fit."""


@dataclass
class Checkpoint:
    config: Config
    vocab: Vocab
    step: int
    params: dict[str, np.ndarray]
    optimizer: dict[str, np.ndarray] = field(default_factory=dict)
    state: tuple = ()
    position: dict | None = None          # data.Streams.position()
    corpus: dict | None = None            # source, sha256, length
    history: dict[str, np.ndarray] = field(default_factory=dict)


def _arrays(ckpt: Checkpoint) -> dict:
    meta = {"config": asdict(ckpt.config), "vocab": ckpt.vocab.chars, "step": int(ckpt.step),
            "position": ckpt.position, "corpus": ckpt.corpus}
    arrays = {"format": np.array(FORMAT), "meta": np.array(json.dumps(meta))}
    arrays.update({f"param/{k}": v for k, v in ckpt.params.items()})
    arrays.update({f"opt/{k}": v for k, v in ckpt.optimizer.items()})
    arrays.update({f"state/{i}": s for i, s in enumerate(ckpt.state)})
    arrays.update({f"history/{k}": np.asarray(v) for k, v in ckpt.history.items()})
    return arrays


def save(path, ckpt: Checkpoint) -> None:
    """Write ckpt to path atomically (temp file + fsync + os.replace)."""
    arrays = _arrays(ckpt)
    with atomic_write(path) as f:
        np.savez(f, **arrays)


def probe(path, ckpt: Checkpoint) -> int:
    """Write ckpt as save() would, beside path, then delete it, leaving path
    as it was: OSError where a checkpoint cannot be written there (folder
    not writable, read-only file system, not enough space for one more
    checkpoint beside the existing one). Returns the bytes written."""
    arrays = _arrays(ckpt)
    with atomic_write(path, commit=False) as f:
        np.savez(f, **arrays)
        f.flush()
        return f.tell()


def _temp_prefix(path: Path) -> str:
    return f".{path.name}."


_TEMP = re.compile(r"\.(?P<pid>\d+)@(?P<host>[0-9a-f]{8})\.[^.]*\.tmp$")


def _host_tag() -> str:
    return f"{zlib.crc32(socket.gethostname().encode()):08x}"


@contextmanager
def atomic_write(path, commit: bool = True):
    """A binary file object whose contents replace path only once the block
    succeeds: a temporary file beside it, synced, then renamed over it (with
    the permissions a new file would get); on error (or interruption: any
    BaseException) path is untouched and the temporary file removed.
    commit False: the temporary file is removed at the end instead (a
    trial write)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f"{_temp_prefix(path)}{os.getpid()}@{_host_tag()}.",
                               suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if commit:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
            os.replace(tmp, path)
        else:
            os.unlink(tmp)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def remove_stale_temps(path) -> list[Path]:
    """Delete the temporary files of atomic_write(path) that a process
    killed mid-write (SIGKILL, power loss) left beside path: those whose
    writer (pid, on this machine) no longer runs. Returns what it removed."""
    path = Path(path)
    removed = []
    try:
        candidates = list(path.parent.glob(f"{glob_escape(_temp_prefix(path))}*.tmp"))
    except OSError:
        return removed
    host = _host_tag()
    for tmp in candidates:
        m = _TEMP.match(tmp.name[len(_temp_prefix(path)) - 1:])
        if m is None or m["host"] != host or _alive(int(m["pid"])):
            continue
        try:
            tmp.unlink()
            removed.append(tmp)
        except OSError:
            pass
    return removed


def glob_escape(s: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", s)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:            # EPERM: it exists
        return True
    return True


def is_checkpoint(path) -> bool:
    """Whether path is (at first sight) a halstm checkpoint: a zip archive
    with a "format" array. Not a validation: see load()."""
    try:
        with zipfile.ZipFile(path) as z:
            return "format.npy" in z.namelist()
    except (OSError, zipfile.BadZipFile, ValueError):
        return False


# ---- reading ------------------------------------------------------------------

def load(path) -> Checkpoint:
    """Read and check a checkpoint. CheckpointError (one line, naming path
    and what does not fit) if the file cannot be read, is damaged, or its
    arrays do not fit its own header; nothing is allocated beyond what the
    file holds."""
    path = Path(path)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: is a folder, not a checkpoint file") from None
    except PermissionError:
        raise CheckpointError(f"{path}: permission denied") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it: {e.strerror or _short(e)}") from None
    with f:
        try:
            return _Reader(path, f).read()
        except CheckpointError:
            raise
        except (OSError, EOFError, zipfile.BadZipFile, zlib.error, ValueError, TypeError,
                KeyError, OverflowError, RecursionError, UnicodeError) as e:
            raise CheckpointError(f"{path} is not a readable halstm checkpoint (corrupt or "
                                  f"another kind of file: {_short(e)})") from None


class _Reader:
    """One load(): the archive's members, checked before they are read."""

    def __init__(self, path: Path, f):
        self.path, self.f = path, f

    def fail(self, what: str):
        raise CheckpointError(f"{self.path}: {what}")

    def read(self) -> Checkpoint:
        st = os.fstat(self.f.fileno())
        if not _is_regular(st.st_mode):
            self.fail("not a regular file")
        size = st.st_size
        if not zipfile.is_zipfile(self.f):
            raise CheckpointError(f"{self.path} is not a readable halstm checkpoint (corrupt or "
                                  f"another kind of file: not an .npz archive)")
        self.f.seek(0)
        with zipfile.ZipFile(self.f) as z:
            self.z = z
            self.members = {}
            for info in z.infolist():
                name = info.filename[:-4] if info.filename.endswith(".npy") else None
                if name is None:
                    self.fail(f"unexpected member {info.filename[:80]!r} (not an array)")
                if name in self.members:
                    self.fail(f"array {name[:80]!r} appears twice")
                if info.compress_type != zipfile.ZIP_STORED:
                    self.fail(f"array {name[:80]!r} is compressed (checkpoints are written "
                              f"uncompressed)")
                if info.file_size > size or info.compress_size > size:
                    self.fail(f"array {name[:80]!r} claims {info.file_size} bytes, more than "
                              f"the file's {size} (damaged or tampered)")
                self.members[name] = info
            return self._read()

    def _read(self) -> Checkpoint:
        path = self.path
        if "format" not in self.members:
            raise CheckpointError(f"{path} is not a halstm char-LM checkpoint (format "
                                  f"'missing', expected {FORMAT!r})")
        fmt = self.array("format", small=True)
        if fmt.dtype.kind != "U" or fmt.shape != () or str(fmt) != FORMAT:
            raise CheckpointError(f"{path} is not a halstm char-LM checkpoint (format "
                                  f"{str(fmt)[:40]!r}, expected {FORMAT!r})")
        if "meta" not in self.members:
            self.fail("has no header (array 'meta')")
        try:
            meta_a = self.array("meta", small=True)
            if meta_a.dtype.kind != "U" or meta_a.shape != ():
                raise ValueError(f"header: expected a string, got {meta_a.dtype} {meta_a.shape}")
            meta = json.loads(str(meta_a))
            if not isinstance(meta, dict):
                raise ValueError("header: expected a JSON object")
            if not isinstance(meta.get("config"), dict):
                raise ValueError("config: expected a JSON object")
            config = Config.from_dict(meta["config"])
            if not isinstance(meta.get("vocab"), str):
                raise ValueError(f"vocab: expected a string, got {type(meta.get('vocab')).__name__}")
            vocab = Vocab(meta["vocab"])
            step = meta["step"]
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise ValueError(f"step: expected an int >= 0, got {step!r}")
            for key in ("position", "corpus"):
                if meta.get(key) is not None and not isinstance(meta[key], dict):
                    raise ValueError(f"{key}: expected a JSON object, got "
                                     f"{type(meta[key]).__name__}")
        except (KeyError, TypeError, ValueError, RecursionError) as e:
            raise CheckpointError(f"{path} has a corrupt header: {_short(e)}") from None

        expected = self.expected(config, len(vocab))
        described = (f"the header's config ({config.cell}, hidden_size {config.hidden_size}, "
                     f"layers {config.layers}, batch_size {config.batch_size}, "
                     f"{config.optimizer}) with {len(vocab)} characters")
        unexpected = sorted(set(self.members) - set(expected) - {"format", "meta"})
        if unexpected:
            self.fail(f"unexpected array {unexpected[0]!r} (not part of a checkpoint of "
                      f"{described})")
        missing = [k for k in expected if k not in self.members]
        if missing:
            self.fail(f"array {missing[0]!r} is missing ({described} needs it)")
        headers = {}
        for name, (dtype, shape) in expected.items():
            got_dtype, got_shape = headers[name] = self.header(name)
            if got_dtype != dtype:
                self.fail(f"array {name!r} is {got_dtype}, expected {np.dtype(dtype)}")
            if shape is not None and got_shape != shape:
                self.fail(f"array {name!r} has shape {got_shape}, but {described} needs {shape}")
            if shape is None and len(got_shape) != 1:
                self.fail(f"array {name!r} has shape {got_shape}, expected one axis")
        for a, b in (("train_step", "train_loss"), ("val_step", "val_loss")):
            na, nb = headers[f"history/{a}"][1], headers[f"history/{b}"][1]
            if na != nb:
                self.fail(f"history/{a} has {na[0]} entries but history/{b} {nb[0]}")

        arrays = {name: self.array(name) for name in expected}
        if int(arrays["opt/t"]) < 0:
            self.fail(f"array 'opt/t' is negative ({int(arrays['opt/t'])})")

        def group(prefix):
            return {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}

        state = group("state/")
        return Checkpoint(config=config, vocab=vocab, step=step, params=group("param/"),
                          optimizer=group("opt/"),
                          state=tuple(state[str(i)] for i in range(len(state))),
                          position=meta.get("position"), corpus=meta.get("corpus"),
                          history=group("history/"))

    @staticmethod
    def expected(config: Config, V: int) -> dict:
        """name -> (dtype, shape or None: any length) of every array but
        format and meta."""
        f32 = np.dtype(np.float32)
        params = parameter_shapes(V, config.cell, config.hidden_size, config.layers)
        out = {f"param/{k}": (f32, s) for k, s in params.items()}
        out["opt/t"] = (np.dtype(np.int64), ())
        slots = {"adam": ("m", "v"), "sgd": ("momentum",) if config.momentum else ()}
        for slot in slots[config.optimizer]:
            out.update({f"opt/{slot}/{k}": (f32, s) for k, s in params.items()})
        n_states = len(cells.info(config.cell)["states"])
        for i in range(n_states):
            out[f"state/{i}"] = (f32, (config.layers, config.batch_size, config.hidden_size))
        out.update({f"history/{k}": (np.dtype(t), None) for k, t in HISTORY.items()})
        return out

    def header(self, name: str) -> tuple:
        """(dtype, shape) from the member's .npy header, checked against the
        member's size: the data must be exactly the bytes the shape needs."""
        info = self.members[name]
        with self.z.open(info) as m:
            version = np.lib.format.read_magic(m)
            if version not in ((1, 0), (2, 0), (3, 0)):
                self.fail(f"array {name!r} has an unknown .npy version {version}")
            reader = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                      else np.lib.format.read_array_header_2_0)
            shape, _fortran, dtype = reader(m)
            offset = m.tell()
        if dtype.hasobject:
            self.fail(f"array {name!r} holds Python objects (never in a checkpoint)")
        if any(not isinstance(n, int) or n < 0 for n in shape):
            self.fail(f"array {name!r} has an invalid shape {shape}")
        need = math.prod(shape) * dtype.itemsize
        have = info.file_size - offset
        if need != have:
            self.fail(f"array {name!r} claims shape {shape} ({need} bytes of {dtype}) but the "
                      f"file holds {have} bytes for it (damaged or tampered)")
        return dtype, tuple(shape)

    def array(self, name: str, small: bool = False) -> np.ndarray:
        """The member's array, its header checked first; the member read to
        its end so that zipfile checks its CRC."""
        if small:
            dtype, shape = self.header(name)
            if math.prod(shape) * dtype.itemsize > (16 << 20):
                self.fail(f"array {name!r} is {shape} {dtype}: too large for a header")
        with self.z.open(self.members[name]) as m:
            a = np.lib.format.read_array(m, allow_pickle=False)
            if m.read(1):
                self.fail(f"array {name!r} has trailing bytes")
        return a


def _is_regular(mode) -> bool:
    import stat
    return stat.S_ISREG(mode)


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return (msg[0] if msg else type(e).__name__)[:200]
