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
_INTEGERS = (0, 1, 2, 3, 4, 5, 10, 11)
MAX_EXPERTS = 1024  # llama.cpp's LLAMA_MAX_EXPERTS
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")  # llama.cpp's names
# An array of integers up to this long is read (a per-layer count); longer ones are skipped.
_READ_ARRAY = MAX_LAYERS
Scalar = int | float | bool | str | tuple[int, ...]


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
        """A scalar value, a short array of integers as a tuple, or None for another array
        (skipped)."""
        if kind in _SCALARS:
            return self.take(*_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array()
        raise ModelLoadError(f"{self.path!r} has a GGUF value of unknown type {kind}")

    def array(self) -> tuple[int, ...] | None:
        kind, n = int(self.take("<I", 4)), self.u64()
        if kind in _INTEGERS and n <= _READ_ARRAY:
            return tuple(int(self.take(*_SCALARS[kind])) for _ in range(n))
        if kind in _SCALARS:
            self.at += n * _SCALARS[kind][1]
        elif kind == _STRING:
            for _ in range(n):
                length = self.u64()
                self.at += length
        elif kind == _ARRAY:  # llama.cpp refuses arrays of arrays too
            raise ModelLoadError(f"{self.path!r} has a GGUF array of arrays: not a model")
        else:
            raise ModelLoadError(f"{self.path!r} has a GGUF array of unknown type {kind}")
        if self.at > len(self.data):
            raise ModelLoadError(f"{self.path!r} is truncated: its GGUF header ends early")
        return None


def read_scalars(path: str) -> dict[str, Scalar]:
    """The scalar key-values of a GGUF file's header, and its short arrays of integers
    (other arrays are skipped).

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
        ModelLoadError: a layer count outside [1, 512], an embedding size of 0, a float
            hyper-parameter that is not finite (or a negative norm epsilon), a rope scaling
            type llama.cpp does not know, multi-token prediction layers beyond the layers, or
            expert counts that do not fit together (see :func:`_check_experts`).
    """
    kv = read_scalars(path)
    arch = kv.get("general.architecture")
    if not isinstance(arch, str):
        return
    _check_keys(path, arch, kv)
    _check_experts(path, arch, kv)


def _check_keys(path: str, arch: str, kv: dict[str, Scalar]) -> None:
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
        if name == "rope.scaling.type" and value not in ROPE_SCALING_TYPES:
            _refuse(path, key, value, f"is none of llama.cpp's ({', '.join(ROPE_SCALING_TYPES)})")
        if name == "nextn_predict_layers" and _count(kv.get(f"{arch}.block_count")) < _count(value):
            _refuse(path, key, value, "is more than the model's layers (block_count)")


def _count(value: Scalar | None) -> int:
    """A count as llama.cpp reads it (absent: 0; the largest of a per-layer array)."""
    if isinstance(value, tuple):
        return max(value, default=0)
    return int(value) if isinstance(value, int) else 0


def _check_experts(path: str, arch: str, kv: dict[str, Scalar]) -> None:
    """The expert counts of a mixture-of-experts model, as llama.cpp asserts them."""
    experts = _count(kv.get(f"{arch}.expert_count"))
    layers = _count(kv.get(f"{arch}.block_count"))
    used_value = kv.get(f"{arch}.expert_used_count")
    # (per layer: llama.cpp reads the first block_count entries)
    used = _count(used_value[:layers] if isinstance(used_value, tuple) else used_value)
    groups = _count(kv.get(f"{arch}.expert_group_count"))
    group_used = _count(kv.get(f"{arch}.expert_group_used_count"))
    if arch in ("hunyuan-dense", "hunyuan_vl") and experts <= 1:
        return  # llama.cpp reads these as no experts
    key = f"{arch}.expert_count"
    if experts > MAX_EXPERTS:
        _refuse(path, key, experts, f"is over llama.cpp's limit of {MAX_EXPERTS}")
    if used > experts:
        _refuse(path, f"{arch}.expert_used_count", used, f"is more than {key} ({experts})")
    if experts > 0 and used == 0:
        _refuse(path, key, experts, "is set, but expert_used_count is not")
    if experts > 0 and groups >= experts:
        _refuse(path, f"{arch}.expert_group_count", groups, f"is not below {key} ({experts})")
    if experts > 0 and groups > 1 and not (experts % groups == 0 and 0 < group_used < groups):
        _refuse(
            path,
            f"{arch}.expert_group_count",
            groups,
            f"does not divide {key} ({experts}) with 0 < expert_group_used_count "
            f"({group_used}) < it",
        )
    if experts == 0 and groups > 0:
        _refuse(path, f"{arch}.expert_group_count", groups, "is set without experts")


def _refuse(path: str, key: str, value: Scalar, why: str) -> None:
    raise ModelLoadError(f"{path!r} has {key} = {value!r}, which {why}: not a loadable model")
