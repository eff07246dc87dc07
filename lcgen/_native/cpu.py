"""Whether llama.cpp's extra CPU weight buffers (AMX tiles, repacked quantized layouts) can run
here.

On a CPU that reports AMX, ggml multiplies quantized weights with AMX tile instructions. Some
virtual machines report AMX but fault on its instructions, and the process dies on the first
decode (seen: a Firecracker VM whose kernel grants the AMX permission). A crash cannot be caught
in the process, so on such a CPU the model being loaded is decoded once in a child process; if
the child dies of a signal, models load without the extra buffers (plain CPU kernels, a little
slower). The verdict is remembered in lcgen's cache folder, per machine and model file.
``LCGEN_CPU_EXTRA_BUFFERS=0`` or ``1`` decides without a probe.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import llama_cpp as C

from lcgen._resources import user_cache_dir

ENV = "LCGEN_CPU_EXTRA_BUFFERS"
_PROBE_TIMEOUT_S = 300
_lock = threading.Lock()
_known: dict[str, bool] = {}

# Load the model with llama.cpp's defaults on the CPU and decode a batch and a single token:
# the paths a generation takes. Exits 0 when that works; a broken AMX unit kills it.
_PROBE = """
import os, sys, llama_cpp as C
quiet = C.llama_log_callback(lambda *args: None)  # referenced while llama.cpp may call it
C.llama_log_set(quiet, None)
C.llama_backend_init()
params = C.llama_model_default_params()
params.n_gpu_layers = 0
model = C.llama_model_load_from_file(os.fsencode(sys.argv[1]), params)
if not model:
    sys.exit(3)
cparams = C.llama_context_default_params()
cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = 64, 16, 16
ctx = C.llama_init_from_model(model, cparams)
n_vocab = C.llama_vocab_n_tokens(C.llama_model_get_vocab(model))
tokens = (C.llama_token * 16)(*[(7 * i + 11) % n_vocab for i in range(16)])
for n in (16, 1):
    if C.llama_decode(ctx, C.llama_batch_get_one(tokens, n)) != 0:
        sys.exit(4)
"""


def extra_buffers_usable(path: str) -> bool:
    """Whether to load ``path`` with llama.cpp's extra CPU buffer types (see the module)."""
    forced = os.environ.get(ENV, "").strip()
    if forced in {"0", "1"}:
        return forced == "1"
    if not _cpu_reports_amx():
        return True
    machine = _machine_key()
    key = f"{machine}:{_file_key(path)}"
    with _lock:
        cached = _known.get(machine, _known.get(key))
        if cached is None:
            stored = _load()
            cached = stored.get(machine, stored.get(key))
        if cached is None:
            cached = _probe(path)
            if cached is not None:
                # A machine that cannot run AMX cannot for any model; one that can, for this one.
                _store(key if cached else machine, cached)
        if cached is None:  # inconclusive (the child failed another way): keep llama.cpp's default
            return True
        _known[key if cached else machine] = cached
        return cached


def _cpu_reports_amx() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_tile" in line.split()
    except OSError:
        pass
    return False


def _machine_key() -> str:
    parts = [os.uname().release, getattr(C, "__version__", "")]
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith(("model name", "flags")):
                parts.append(line.strip())
            if line.strip() == "":
                break
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _file_key(path: str) -> str:
    stat = os.stat(path)
    key = os.fsencode(os.path.abspath(path)) + f":{stat.st_size}".encode()
    return hashlib.sha256(key).hexdigest()[:16]


def _probe(path: str) -> bool | None:
    """True: the child decoded; False: it died of a signal; None: it failed another way."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE, path],
            capture_output=True,
            timeout=_PROBE_TIMEOUT_S,
            env={**os.environ, ENV: "1"},
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode < 0:
        return False
    return True if done.returncode == 0 else None


def _cache_file() -> Path:
    return user_cache_dir() / "cpu-extra-buffers.json"


def _load() -> dict[str, bool]:
    try:
        data = json.loads(_cache_file().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, bool)} if isinstance(data, dict) else {}


def _store(key: str, verdict: bool) -> None:
    """Remember a verdict (best effort: a read-only cache only costs another probe)."""
    data = _load()
    data[key] = verdict
    path = _cache_file()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
        os.replace(tmp, path)
    with contextlib.suppress(OSError):
        tmp.unlink()


def performance_cores() -> int | None:
    """On macOS, the performance cores (``hw.perflevel0.physicalcpu``: llama.cpp's threads
    wait for the slowest, so efficiency cores slow them down); None elsewhere or when the
    system does not say."""
    if sys.platform != "darwin":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        value, size = ctypes.c_int(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_int))
        rc = libc.sysctlbyname(
            b"hw.perflevel0.physicalcpu", ctypes.byref(value), ctypes.byref(size), None, 0
        )
    except (OSError, AttributeError):
        return None
    return value.value if rc == 0 and value.value > 0 else None
