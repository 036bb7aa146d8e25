"""Checkpoints: one .npz file (no pickles) holding everything a run needs to
continue exactly: config, vocabulary, weights, optimizer state, step, the
data position with its RNG state, the carried recurrent state, the corpus
fingerprint and the loss history.

Layout: "format" (a string), "meta" (a JSON string: config, vocab, step,
data position, corpus), "param/<name>", "opt/<name>" (optimizer state,
with "opt/t"), "state/<i>" (the carried (layers, B, H) arrays) and
"history/<series>". Written to a temporary file in the target's folder,
synced, then renamed over the target: a reader sees the old file or the new
one, never half of one.
"""
from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .config import Config
from .data import Vocab

FORMAT = "halstm-charlm/1"


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


def save(path, ckpt: Checkpoint) -> None:
    """Write ckpt to path atomically (temp file + fsync + os.replace)."""
    path = Path(path)
    meta = {"config": asdict(ckpt.config), "vocab": ckpt.vocab.chars, "step": int(ckpt.step),
            "position": ckpt.position, "corpus": ckpt.corpus}
    arrays = {"format": np.array(FORMAT), "meta": np.array(json.dumps(meta))}
    arrays.update({f"param/{k}": v for k, v in ckpt.params.items()})
    arrays.update({f"opt/{k}": v for k, v in ckpt.optimizer.items()})
    arrays.update({f"state/{i}": s for i, s in enumerate(ckpt.state)})
    arrays.update({f"history/{k}": np.asarray(v) for k, v in ckpt.history.items()})
    with atomic_write(path) as f:
        np.savez(f, **arrays)


@contextmanager
def atomic_write(path):
    """A binary file object whose contents replace path only once the block
    succeeds: a temporary file beside it, synced, then renamed over it (with
    the permissions a new file would get); on error path is untouched and
    the temporary file removed."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load(path) -> Checkpoint:
    """Read and check a checkpoint. CheckpointError (one line) if the file
    cannot be read or is not a well-formed halstm checkpoint."""
    path = Path(path)
    try:
        z = np.load(path, allow_pickle=False)
        if not isinstance(z, np.lib.npyio.NpzFile):
            raise ValueError("a single .npy array, not an .npz archive")
        with z:
            arrays = {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: is a folder, not a checkpoint file") from None
    except PermissionError:
        raise CheckpointError(f"{path}: permission denied") from None
    except Exception as e:  # zipfile, zlib, numpy's format errors: all mean "corrupt"
        raise CheckpointError(f"{path} is not a readable halstm checkpoint (corrupt or "
                              f"another kind of file: {_short(e)})") from None
    if "format" not in arrays or str(arrays["format"]) != FORMAT:
        raise CheckpointError(f"{path} is not a halstm char-LM checkpoint (format "
                              f"{str(arrays.get('format', 'missing'))[:40]!r}, expected {FORMAT!r})")
    try:
        meta = json.loads(str(arrays["meta"]))
        config = Config.from_dict(meta["config"])
        vocab = Vocab(meta["vocab"])
        step = int(meta["step"])
        if step < 0:
            raise ValueError(f"negative step {step}")
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path} has a corrupt header: {_short(e)}") from None

    def group(prefix):
        return {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}

    state = group("state/")
    return Checkpoint(config=config, vocab=vocab, step=step, params=group("param/"),
                      optimizer=group("opt/"),
                      state=tuple(state[str(i)] for i in range(len(state)) if str(i) in state),
                      position=meta.get("position"), corpus=meta.get("corpus"),
                      history=group("history/"))


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return (msg[0] if msg else type(e).__name__)[:200]
