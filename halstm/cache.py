"""The on-disk cache of compiled libraries, shared by the recurrent layers
(aot.py) and any other kernels built through it (the char LM's).

One folder per key under cache_dir() (HALSTM_CACHE overrides the user
cache directory). A key hashes what the compiled code depends on, given
as a dict by the caller, plus Halide's version and, for "host" targets,
this machine's CPU. Sources enter a key without their comments and
docstrings (source_hash), so an edit of the text alone keeps the cache
warm. An entry is built in a temporary folder and renamed into place under
a file lock, so concurrent builders of one key both succeed and a failed
or interrupted build leaves nothing behind; an entry whose library does
not match its manifest's checksum is rebuilt.
"""
from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import tempfile
import time
from functools import lru_cache
from pathlib import Path
from typing import Callable

from filelock import FileLock

from .errors import CacheError

MANIFEST = "manifest.json"


def cache_dir() -> Path:
    env = os.environ.get("HALSTM_CACHE")
    if env:
        return Path(env)
    import platformdirs
    return Path(platformdirs.user_cache_dir("halstm"))


def root() -> Path:
    """cache_dir(), created private (0700) if missing, and checked: a
    folder this user owns and can write, which no other user can write
    (a library loaded from it runs its code). Raises CacheError."""
    path = cache_dir()
    where = f"the kernel cache folder {path} (HALSTM_CACHE, or the user cache directory)"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise CacheError(f"{where}: expected a folder, got a file") from None
    except OSError as e:
        raise CacheError(f"{where}: cannot create it: {e.strerror}") from None
    if not path.is_dir():
        raise CacheError(f"{where}: expected a folder, got a file")
    st = path.stat()
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise CacheError(f"{where}: expected a folder of this user's, got one of uid "
                         f"{st.st_uid}; loading a library from it would run its code")
    if st.st_mode & 0o022:
        raise CacheError(f"{where}: expected a folder only its owner can write, got mode "
                         f"{st.st_mode & 0o777:o}; loading a library from it would run code "
                         f"others can put there (chmod go-w it, or set HALSTM_CACHE)")
    if not os.access(path, os.W_OK | os.X_OK):
        raise CacheError(f"{where}: not writable")
    return path


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _python_code(text: str) -> str:
    """The code of a Python source: its syntax tree without docstrings
    (comments and layout are not in the tree)."""
    tree = ast.parse(text)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


# C and C++: string and character literals (kept), comments (dropped)
_C_TOKENS = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|//[^\n]*|/\*.*?\*/', re.S)


def _c_code(text: str) -> str:
    """The code of a C or C++ source: comments dropped, each line's
    surrounding blanks trimmed, blank lines dropped (lines stay lines: the
    preprocessor reads them)."""
    text = _C_TOKENS.sub(lambda m: " " if m.group(0)[0] == "/" else m.group(0), text)
    return "\n".join(line.strip() for line in text.splitlines() if line.strip())


def source_hash(files) -> str:
    """Hash of the code in `files` (Python or C/C++ by suffix), by name and
    content without comments and docstrings."""
    h = hashlib.sha256()
    for f in sorted(map(Path, files), key=lambda p: (p.parent.name, p.name)):
        text = f.read_text()
        code = _python_code(text) if f.suffix == ".py" else _c_code(text)
        h.update(f"{f.parent.name}/{f.name}".encode() + b"\0" + code.encode() + b"\0")
    return h.hexdigest()[:16]


@lru_cache(maxsize=None)
def host_fingerprint() -> str:
    """What "host" means here: the CPU's model and feature flags."""
    info = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features", "CPU part")):
                    info += line
                if line.strip() == "":
                    break
    except OSError:
        pass
    return hashlib.sha256(info.encode()).hexdigest()[:16]


@lru_cache(maxsize=None)
def halide_version() -> str:
    """Halide's version, from the package metadata or, for a Halide copied
    without it (the GPU machines' bundle), from its CMake package files."""
    try:
        return importlib.metadata.version("halide")
    except importlib.metadata.PackageNotFoundError:
        spec = importlib.util.find_spec("halide")
        if spec is None or not spec.origin:
            raise
        cfg = Path(spec.origin).parent / "lib64/cmake/Halide/HalideConfigVersion.cmake"
        m = re.search(r'set\(PACKAGE_VERSION "([^"]+)"\)', cfg.read_text())
        if m is None:
            raise
        return m.group(1)


def key(material: dict, target: str, prefix: str = "") -> str:
    """The cache key of an entry whose code depends on `material` (JSON
    data) and is built for `target` (a target string)."""
    material = {**material, "target": target, "halide": halide_version()}
    if "host" in target.split("-"):
        material["host"] = host_fingerprint()
    return prefix + hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:24]


def read_entry(folder: Path, format, check: Callable[[dict], None] | None = None) -> dict | None:
    """The manifest of a complete, intact entry of `format`, else None:
    check(manifest) raises ValueError (or KeyError, TypeError) on a
    manifest of the wrong shape, and the library's checksum must match,
    before anything loads it."""
    try:
        manifest = json.loads((Path(folder) / MANIFEST).read_text())
        if not isinstance(manifest, dict) or manifest.get("format") != format:
            return None
        if check is not None:
            check(manifest)
        library = manifest["library"]
        if not isinstance(library, str) or Path(library).name != library:
            return None
        if file_sha256(Path(folder) / library) != manifest["sha256"]:
            return None
        return manifest
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_manifest(folder: Path, manifest: dict) -> None:
    """folder/manifest.json, written last and whole (a manifest means a
    finished build)."""
    tmp = Path(folder) / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, Path(folder) / MANIFEST)


def entry(key: str, format, build: Callable[[Path], dict],
          check: Callable[[dict], None] | None = None) -> tuple[Path, dict]:
    """The cached library under `key`: (path of the .so, manifest).
    Missing or damaged (see read_entry), it is first built by build(folder),
    which writes a library and a manifest (with "format", "library" and
    "sha256") into the empty folder it is given and returns the manifest."""
    base = root()
    folder = base / key
    manifest = read_entry(folder, format, check)
    if manifest is not None:
        return folder / manifest["library"], manifest
    _remove_stale_builds(base)
    with FileLock(str(base / f"{key}.lock")):
        manifest = read_entry(folder, format, check)   # another process may have built it
        if manifest is None:
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=base))
            try:
                manifest = build(tmp)
                if folder.is_symlink() or folder.is_file():   # something else in its place
                    folder.unlink()
                elif folder.exists():          # a damaged entry: replace it
                    shutil.rmtree(folder)
                os.rename(tmp, folder)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return folder / manifest["library"], manifest


def _remove_stale_builds(root: Path, age_s: float = 3600) -> None:
    """Delete temporary build folders that a killed process left behind."""
    now = time.time()
    for tmp in root.glob(".tmp-*"):
        try:
            if now - tmp.stat().st_mtime > age_s:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass
