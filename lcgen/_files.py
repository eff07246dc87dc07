"""Reading a file a user names (a schema, a grammar, a saved chat), with a bound; and making a
rename durable.

Such files are kilobytes. Without a bound, a device (``/dev/zero``) or a huge file named by
mistake was read whole into memory until the process was killed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

#: The most bytes lcgen reads of a file an option, a chat command or ``Grammar.from_file``
#: names: a chat holds no more than its context (a million tokens are some 4 MiB of text).
MAX_FILE_BYTES = 16 * 2**20


def read_bounded(path: str | os.PathLike[str]) -> bytes:
    """The bytes of a regular file or a pipe (``--json-schema <(...)``), at most
    :data:`MAX_FILE_BYTES` of them.

    Raises:
        OSError: the file cannot be read (a directory: ``IsADirectoryError``).
        ValueError: it is a device or a socket, or over the bound (the bound named).
    """
    path = Path(path)
    mode = path.stat().st_mode
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
        raise ValueError("not a regular file (a device or a socket): give a file's path")
    with path.open("rb") as file:
        data = file.read(MAX_FILE_BYTES + 1)  # a file that grows, or a pipe: bounded too
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"the file is over {MAX_FILE_BYTES // 2**20} MiB, the most lcgen reads")
    return data


def sync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (best effort: some systems cannot open a folder)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
