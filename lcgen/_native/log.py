"""Backend set-up and llama.cpp's log, captured so its error lines end up in lcgen's errors."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import llama_cpp as C

_LOG_LEVEL_ERROR = 4
_LOG_LEVEL_CONT = 5

_log_tail: deque[tuple[int, str]] = deque(maxlen=200)
_log_count = 0
_verbose = 0  # verbose models open (llama.cpp's log is one for the process)
_init_lock = threading.Lock()
_initialized = False
_stderr_lock = threading.Lock()


# Ctrl-C during a call into llama.cpp is raised in the next callback into Python, where ctypes
# would print it and drop it (a model loading went on to the end): it is kept here (by the
# callbacks, or by the hook of exceptions Python cannot raise, where one escapes them as the
# callback starts), a load stops at its next progress report, and the caller raises it
# (take_interrupt).
_interrupt = threading.Event()
_CALLBACKS = ("_on_log", "_on_progress")


def _keep_interrupts(previous: Callable[[Any], object]) -> Callable[[Any], object]:
    def hook(unraisable: Any) -> object:
        exc_type = getattr(unraisable, "exc_type", None)
        where = getattr(unraisable, "object", None)
        ours = getattr(where, "__module__", None) == __name__ and (
            getattr(where, "__name__", None) in _CALLBACKS
        )
        if ours and isinstance(exc_type, type) and issubclass(exc_type, KeyboardInterrupt):
            _interrupt.set()
            return None
        return previous(unraisable)

    return hook


@C.llama_log_callback  # type: ignore[untyped-decorator]
def _on_log(level: int, text: bytes | None, _user_data: ctypes.c_void_p) -> None:
    global _log_count
    try:
        msg = (text or b"").decode("utf-8", "replace")
        if level == _LOG_LEVEL_CONT and _log_tail:
            prev_level, prev = _log_tail.pop()
            _log_tail.append((prev_level, prev + msg))
        else:
            _log_tail.append((level, msg))
            _log_count += 1
        if _verbose:
            sys.stderr.write(msg)
    except KeyboardInterrupt:
        _interrupt.set()


@C.llama_progress_callback  # type: ignore[untyped-decorator]
def _on_progress(_progress: float, _user_data: ctypes.c_void_p) -> bool:
    """Whether a model's load goes on: not after Ctrl-C."""
    try:
        return not _interrupt.is_set()
    except KeyboardInterrupt:
        _interrupt.set()
        return False


def take_interrupt() -> bool:
    """Whether Ctrl-C came during a call into llama.cpp since the last look (and forget it)."""
    interrupted = _interrupt.is_set()
    _interrupt.clear()
    return interrupted


# The callback objects must outlive every call into llama.cpp (a collected callback
# segfaults): they are referenced here, at module level, for the life of the process.
_LOG_CALLBACK = _on_log
PROGRESS_CALLBACK = _on_progress


def init() -> None:
    """Initialize the backend once per process and route llama.cpp's log through lcgen."""
    global _initialized
    with _init_lock:
        if _initialized:
            return
        sys.unraisablehook = _keep_interrupts(sys.unraisablehook)
        C.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
        C.llama_backend_init()
        _initialized = True


def is_verbose() -> bool:
    """Whether llama.cpp's log goes to stderr: while a model loaded with ``verbose=True`` is
    open (it stayed on for the rest of the process)."""
    return _verbose > 0


def set_verbose(on: bool) -> None:
    """Count a verbose model in (``on``) or out, as it is loaded and closed."""
    global _verbose
    with _init_lock:
        _verbose = max(0, _verbose + (1 if on else -1))


def log_mark() -> int:
    """A position in the log; pass it to :func:`log_errors_since`."""
    return _log_count


def log_errors_since(mark: int) -> str:
    """The error (and, failing that, warning) lines llama.cpp logged since ``mark``."""
    n_new = min(_log_count - mark, len(_log_tail))
    recent = list(_log_tail)[len(_log_tail) - n_new :] if n_new > 0 else []
    errors = [m.strip() for level, m in recent if level >= _LOG_LEVEL_ERROR - 1 and m.strip()]
    return "; ".join(errors[-4:])


@contextlib.contextmanager
def capture_stderr_fd() -> Iterator[list[bytes]]:
    """Collect what C code writes to file descriptor 2 (the grammar parser prints its errors
    there, not to the log); yields a list that holds the bytes once the block ends."""
    captured: list[bytes] = []
    with _stderr_lock, tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        saved = -1
        try:  # (one block: Ctrl-C between the steps still gives fd 2 back and closes the copy)
            with contextlib.suppress(OSError):  # no stderr to redirect: run uncaptured
                saved = os.dup(2)
            if saved >= 0:
                os.dup2(tmp.fileno(), 2)
            yield captured
        finally:
            if saved >= 0:
                try:
                    os.dup2(saved, 2)
                finally:
                    os.close(saved)
                tmp.seek(0)
                captured.append(tmp.read())


def supports_gpu_offload() -> bool:
    return bool(C.llama_supports_gpu_offload())


def system_info() -> str:
    """llama.cpp's version and the CPU features its kernels were built for and found."""
    info = bytes(C.llama_print_system_info()).decode("utf-8", "replace").strip()
    return f"llama-cpp-python {getattr(C, '__version__', '?')}: {info}"
