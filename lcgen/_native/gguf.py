"""A GGUF file's key-value header, read before llama.cpp sees the file.

llama.cpp asserts on some hyper-parameters (a layer count of 0 or above 512, a norm epsilon
that is not a number), and an assertion ends the process. The scalar values of the header are
read here and checked first, so such a file raises :class:`~lcgen.ModelLoadError` instead.
"""

from __future__ import annotations

import math
import mmap
import struct

from lcgen.errors import ModelLoadError

MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS

# GGUF value types: (struct format, size) for the fixed-size ones.
_SCALARS = {
    0: ("<B", 1),
    1: ("<b", 1),
    2: ("<H", 2),
    3: ("<h", 2),
    4: ("<I", 4),
    5: ("<i", 4),
    6: ("<f", 4),
    7: ("<?", 1),
    10: ("<Q", 8),
    11: ("<q", 8),
    12: ("<d", 8),
}
_STRING, _ARRAY = 8, 9
Scalar = int | float | bool | str


class _Reader:
    def __init__(self, data: mmap.mmap, path: str) -> None:
        self.data, self.path, self.at = data, path, 0

    def take(self, fmt: str, size: int) -> int | float | bool:
        if self.at + size > len(self.data):
            raise ModelLoadError(f"{self.path!r} is truncated: its GGUF header ends early")
        (value,) = struct.unpack_from(fmt, self.data, self.at)
        self.at += size
        return value  # type: ignore[no-any-return]

    def u64(self) -> int:
        return int(self.take("<Q", 8))

    def string(self) -> str:
        n = self.u64()
        if self.at + n > len(self.data):
            raise ModelLoadError(f"{self.path!r} is truncated: its GGUF header ends early")
        text = bytes(self.data[self.at : self.at + n]).decode("utf-8", "replace")
        self.at += n
        return text

    def value(self, kind: int) -> Scalar | None:
        """A scalar value, or None for an array (skipped)."""
        if kind in _SCALARS:
            return self.take(*_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            self.skip_array()
            return None
        raise ModelLoadError(f"{self.path!r} has a GGUF value of unknown type {kind}")

    def skip_array(self) -> None:
        kind, n = int(self.take("<I", 4)), self.u64()
        if kind in _SCALARS:
            self.at += n * _SCALARS[kind][1]
        elif kind == _STRING:
            for _ in range(n):
                length = self.u64()
                self.at += length
        else:  # arrays of arrays do not occur in models
            for _ in range(n):
                self.value(kind)
        if self.at > len(self.data):
            raise ModelLoadError(f"{self.path!r} is truncated: its GGUF header ends early")


def read_scalars(path: str) -> dict[str, Scalar]:
    """The scalar key-values of a GGUF file's header (arrays are skipped).

    Raises:
        ModelLoadError: the header is truncated or malformed.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        reader = _Reader(data, path)
        reader.at = 4  # the magic, checked by the caller
        version = int(reader.take("<I", 4))
        if version < 2:
            return {}  # GGUF v1 (32-bit lengths): llama.cpp refuses it with its own error
        reader.u64()  # tensor count
        n_kv = reader.u64()
        if n_kv > len(data):
            raise ModelLoadError(f"{path!r} claims {n_kv} header entries in {len(data)} bytes")
        out: dict[str, Scalar] = {}
        for _ in range(n_kv):
            key = reader.string()
            value = reader.value(int(reader.take("<I", 4)))
            if value is not None:
                out[key] = value
        return out


def check_hyperparameters(path: str) -> None:
    """Refuse hyper-parameters llama.cpp would abort on, naming the key and its value.

    Raises:
        ModelLoadError: a layer count outside [1, 512], an embedding size of 0, or a float
            hyper-parameter that is not finite (or a negative norm epsilon).
    """
    kv = read_scalars(path)
    arch = kv.get("general.architecture")
    if not isinstance(arch, str):
        return
    for key, value in kv.items():
        if not key.startswith(arch + "."):
            continue
        name = key[len(arch) + 1 :]
        if isinstance(value, float) and not math.isfinite(value):
            _refuse(path, key, value, "is not a finite number")
        if name.endswith("epsilon") and isinstance(value, float) and value < 0:
            _refuse(path, key, value, "is negative")
        if name == "block_count" and not (isinstance(value, int) and 1 <= value <= MAX_LAYERS):
            _refuse(path, key, value, f"is outside [1, {MAX_LAYERS}] (llama.cpp's layer limit)")
        if name == "embedding_length" and isinstance(value, int) and value <= 0:
            _refuse(path, key, value, "must be positive")


def _refuse(path: str, key: str, value: Scalar, why: str) -> None:
    raise ModelLoadError(f"{path!r} has {key} = {value!r}, which {why}: not a loadable model")
