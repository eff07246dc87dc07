"""The saved-state file format: a sequence (``seq.save``) or cache entries
(``model.cache.save``).

A file is::

    magic (7 bytes) | version u32 | header length u32 | header (JSON) | KV length u64 | KV bytes
    | sha256 of everything before it (32 bytes)

The magic is ``b"LCGSEQ\\0"`` for a sequence, ``b"LCGKVS\\0"`` for cache entries. The header
carries the model's fingerprint, the tokens and lcgen's own state; the KV bytes are llama.cpp's
sequence state (for cache entries, one length-prefixed state per entry). Files are written
atomically (temp file, fsync, rename).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import secrets
import stat
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from lcgen._files import sync_folder
from lcgen.errors import StateFileError

FORMAT_VERSION = 1
SEQUENCE = (b"LCGSEQ\x00", "sequence")
CACHE = (b"LCGKVS\x00", "cache")
FileKind = tuple[bytes, str]  # (magic, what it holds: for messages)
_HEAD = struct.Struct("<7sII")
_KV_LEN = struct.Struct("<Q")
_DIGEST = 32
LOGITS = np.dtype("<f4")  # a saved row of logits (the ones kept after a prompt)


def encode(
    header: dict[str, Any],
    kv_size: int,
    write_kv: Callable[[bytearray, int, int], int],
    kind: FileKind = SEQUENCE,
) -> bytearray:
    """The bytes of a saved state, built in one buffer.

    Args:
        header: lcgen's state (JSON-serializable).
        kv_size: the most bytes the KV state takes.
        write_kv: ``write_kv(buffer, offset, size)`` writes the KV state in place and returns
            how many bytes it wrote.
        kind: what the file holds (:data:`SEQUENCE` or :data:`CACHE`).
    """
    head = json.dumps(header, separators=(",", ":")).encode()
    at = _HEAD.size + len(head) + _KV_LEN.size
    out = bytearray(at + kv_size + _DIGEST)
    _HEAD.pack_into(out, 0, kind[0], FORMAT_VERSION, len(head))
    out[_HEAD.size : _HEAD.size + len(head)] = head
    n = write_kv(out, at, kv_size)
    _KV_LEN.pack_into(out, at - _KV_LEN.size, n)
    end = at + n
    with memoryview(out) as view:
        out[end : end + _DIGEST] = hashlib.sha256(view[:end]).digest()
    del out[end + _DIGEST :]
    return out


def logits_bytes(row: np.ndarray) -> bytes:
    """A row of logits as a file holds it (:data:`LOGITS`)."""
    return np.asarray(row, LOGITS).tobytes()


def read_logits(data: memoryview, what: str) -> np.ndarray:
    """A row of logits from a file (its size checked by the caller), read-only.

    Raises:
        StateFileError: a value is not finite (llama.cpp writes none; a call would blame
            the model).
    """
    row = np.frombuffer(data, dtype=LOGITS).astype(np.float32)
    if not np.isfinite(row).all():
        raise StateFileError(f"{what} logits are not all finite numbers")
    row.flags.writeable = False
    return row


def check_kv_types(header: dict[str, Any], types: tuple[str, str], what: str) -> None:
    """Refuse a state saved from a KV cache of other element types (``header["kv"]``; files
    without it are left to llama.cpp's own check).

    Raises:
        StateFileError: naming both caches' types.
    """
    saved = header.get("kv")
    if saved is None:
        return
    if not (isinstance(saved, list) and len(saved) == 2 and all(isinstance(t, str) for t in saved)):
        raise StateFileError(f"{what} has a malformed 'kv' field: {saved!r}")
    if tuple(saved) != types:
        raise StateFileError(
            f"{what} was saved from a KV cache of type_k={saved[0]!r}, type_v={saved[1]!r}; "
            f"this model's is type_k={types[0]!r}, type_v={types[1]!r}: load the model with "
            "the saved types to read it"
        )


def decode(
    data: bytes | bytearray | memoryview, kind: FileKind = SEQUENCE
) -> tuple[dict[str, Any], memoryview]:
    """Check and split a saved state into (header, KV bytes); the KV part is not copied.

    Raises:
        StateFileError: not an lcgen file of this kind, another format version, truncated or
            corrupted.
    """
    magic, what = kind
    try:
        view = memoryview(data).cast("B")
    except TypeError:
        raise TypeError(
            f"a saved {what} is bytes (bytes, bytearray or memoryview), got {type(data).__name__}"
        ) from None
    if len(view) < _HEAD.size + _KV_LEN.size + _DIGEST or view[: len(magic)] != magic:
        raise StateFileError(f"not an lcgen {what} file ({len(view)} bytes, bad header)")
    _, version, head_len = _HEAD.unpack_from(view)
    if version != FORMAT_VERSION:
        raise StateFileError(
            f"{what} file format version {version} is not supported (this lcgen reads "
            f"version {FORMAT_VERSION})"
        )
    body, digest = view[:-_DIGEST], view[-_DIGEST:]
    if hashlib.sha256(body).digest() != digest:
        raise StateFileError(
            f"{what} file is truncated or corrupted (checksum mismatch, {len(view)} bytes)"
        )
    at = _HEAD.size + head_len
    if at + _KV_LEN.size > len(body):
        raise StateFileError(f"{what} file header is longer than the file ({head_len} bytes)")
    (kv_len,) = _KV_LEN.unpack_from(body, at)
    kv = body[at + _KV_LEN.size :]
    if len(kv) != kv_len:
        raise StateFileError(f"{what} file holds {len(kv)} KV bytes, its header says {kv_len}")
    try:  # well formed unless forged: the checksum covers it
        header = json.loads(bytes(body[_HEAD.size : at]))
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested too deep
        raise StateFileError(f"{what} file header is not JSON text: {exc}") from None
    if not isinstance(header, dict):
        raise StateFileError(f"{what} file header is not a JSON object: {header!r:.60}")
    return header, kv


def write_atomic(
    path: str | os.PathLike[str], data: bytes | bytearray, kind: FileKind = SEQUENCE
) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either the old file or the new one.

    The data goes to a temporary file of a name no other writer uses (process, thread and a
    random part), is synced, renamed over ``path``, and the folder is synced. Temporary files
    that writers which died left beside ``path`` are removed.

    A link is followed: the file it names is replaced, not the link. A file replaced keeps
    its permissions (a private one stays private).

    Raises:
        StateFileError: ``path`` cannot be written (a directory, a device or another file that
            is not a regular one, a missing folder, no permission, a full disk...); no
            temporary file is left behind.
    """

    path = _path(path, kind)

    def refused(reason: str) -> StateFileError:
        return StateFileError(f"cannot write {kind[1]} file {str(path)!r}: {reason}")

    if not path:
        raise refused("the path is empty")
    if path.endswith(("/", os.sep)):  # (Path drops the slash: a file was written)
        raise refused("the path ends in a separator, as a folder's does")
    if "\0" in path:  # (os calls say "embedded null byte", naming no file)
        raise refused("a path holds no NUL character")
    target = Path(path)
    try:
        if target.is_symlink():
            target = target.resolve(strict=False)
        is_dir, exists, is_file = target.is_dir(), target.exists(), target.is_file()
    except (OSError, RuntimeError) as exc:  # a name too long, a loop of links
        raise refused(getattr(exc, "strerror", None) or str(exc)) from None
    if is_dir:
        raise refused("it is a directory")
    if exists and not is_file:
        # The rename would replace it: a device node (/dev/null as root), a pipe, a socket.
        raise refused("it is not a regular file (a device, a pipe or a socket)")
    _remove_orphans(target)
    tmp = target.with_name(
        f".{_stem(target)}.{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(4)}.tmp"
    )
    try:
        with open(tmp, "wb") as f:
            with contextlib.suppress(FileNotFoundError):  # a file replaced keeps its mode
                os.chmod(f.fileno(), stat.S_IMODE(target.stat().st_mode))
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        sync_folder(target.parent)
    except OSError as exc:
        reason = "it is a directory" if target.is_dir() else exc.strerror or str(exc)
        raise StateFileError(f"cannot write {kind[1]} file {str(path)!r}: {reason}") from None
    finally:
        with contextlib.suppress(OSError):  # gone (renamed), or never made
            tmp.unlink()


def _stem(target: Path) -> str:
    """The part of ``target``'s name its temporary files start with: a long name's first 120
    characters (the rest of a temporary name must fit the 255 a file name may have)."""
    return target.name[:120]


def _remove_orphans(target: Path) -> None:
    """Remove ``.NAME.<pid>.*.tmp`` files beside ``target`` whose process is gone."""
    stem = _stem(target)
    for tmp in target.parent.glob(f".{glob.escape(stem)}.*.tmp"):
        pid = tmp.name[len(stem) + 2 :].split(".", 1)[0]
        if pid.isdigit() and not _is_alive(int(pid)):
            with contextlib.suppress(OSError):
                tmp.unlink()


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: no process has that id
        return False
    except PermissionError:
        return True
    return True


def _path(path: object, kind: FileKind) -> str:
    """``path`` as text (bytes decoded as the file system does).

    Raises:
        TypeError: ``path`` is not a path (str, bytes or os.PathLike).
    """
    try:
        return os.fsdecode(path)  # type: ignore[arg-type]  # (checked here)
    except TypeError:
        raise TypeError(
            f"a {kind[1]} file's path is a str or os.PathLike, got {type(path).__name__}"
        ) from None


def read_file(path: str | os.PathLike[str], kind: FileKind = SEQUENCE) -> bytes:
    """Read a saved state.

    Raises:
        StateFileError: the file cannot be read, or is not a regular file (a device such as
            /dev/zero would be read until memory ran out, a pipe could block forever).
    """
    path = _path(path, kind)
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise StateFileError(
                f"cannot read {kind[1]} file {str(path)!r}: it is not a regular file (a "
                "directory, a device or a pipe)"
            )
        return Path(path).read_bytes()
    except (OSError, ValueError) as exc:  # (ValueError: a NUL in the path)
        raise StateFileError(f"cannot read {kind[1]} file {str(path)!r}: {exc}") from exc
