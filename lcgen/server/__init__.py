"""``lcgen serve``: an OpenAI-compatible HTTP server over one model (``pip install lcgen[server]``).

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` and
``GET /health``. Every request's choices run in one engine thread through lcgen's scheduler:
a new request joins the running batch at the next step, and all share the model's prefix cache.

::

    python -m lcgen.server smollm2-135m --port 8000
    # or from Python
    from lcgen.server import serve
    serve("smollm2-135m", port=8000)

This module imports nothing of the server's dependencies until a server is started, so the
command line can list ``serve`` without them.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import lcgen

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
_EXTRA = ("starlette", "uvicorn", "sse_starlette")


class ServerExtraMissingError(lcgen.LcgenError, ImportError):
    """The server's dependencies are not installed (``pip install 'lcgen[server]'``)."""


def require_extra() -> None:
    """Raise :class:`ServerExtraMissingError` when a server dependency is missing."""
    missing = [name for name in _EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        raise ServerExtraMissingError(
            f"lcgen's server needs {', '.join(missing)}: pip install 'lcgen[server]'"
        )


def serve(
    model_name_or_path: str | os.PathLike[str] = lcgen.DEFAULT_MODEL,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    api_key: str | None = None,
    n_ctx: int = 4096,
    n_seq_max: int | None = None,
    threads: int | None = None,
    *,
    max_queue: int | None = None,
    draft: str | os.PathLike[str] | None = None,
    verbose: bool = False,
) -> None:
    """Load a model and serve it until interrupted (Ctrl-C).

    Args:
        model_name_or_path: a registry name, ``.gguf`` path or ``hf:`` reference.
        host: the address to bind (127.0.0.1: this machine only).
        port: the TCP port.
        api_key: when set, requests need ``Authorization: Bearer KEY`` (not ``/health``).
        n_ctx: the context size in tokens, shared by all running requests.
        n_seq_max: sequence slots: requests (choices) running at once, and cached prefixes.
        threads: CPU threads (None: the cores, at most 8).
        max_queue: the most choices waiting for a slot before requests get 429 (None: 64).
        draft: a draft model (same vocabulary) for requests with ``speculate: "draft"``.
        verbose: show llama.cpp's log and every request.

    Raises:
        ServerExtraMissingError: the server's dependencies are not installed.
        ModelNotFoundError, ModelLoadError: the model cannot be found or loaded.
    """
    require_extra()
    import uvicorn

    from lcgen.server.app import DEFAULT_MAX_QUEUE, create_app

    ref = str(model_name_or_path)
    # The name clients give: a registry name as given, a file by its name (no directories).
    name = Path(ref).name if ref.endswith(".gguf") else ref
    load = functools.partial(
        lcgen.load, n_ctx=n_ctx, n_seq_max=n_seq_max, n_threads=threads, verbose=verbose
    )
    with contextlib.ExitStack() as stack:
        model = stack.enter_context(load(ref))
        draft_model = None if draft is None else stack.enter_context(load(draft))
        app = create_app(
            model,
            model_name=name,
            api_key=api_key,
            max_queue=DEFAULT_MAX_QUEUE if max_queue is None else max_queue,
            draft_model=draft_model,
        )
        uvicorn.run(app, host=host, port=port, log_level="info" if verbose else "warning")


# command line ------------------------------------------------------------------------------
class Parser(argparse.ArgumentParser):
    """The parser of lcgen's commands (``lcgen``, ``python -m lcgen.server``): a usage error (an
    unknown flag, a bad value, a missing argument) is one line on stderr, status 2, as lcgen's
    other errors are one line."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The server's options on a parser (``lcgen serve`` and ``python -m lcgen.server``)."""
    p.add_argument(
        "model", help="registry name (see `lcgen models`), .gguf path or hf:org/repo/file"
    )
    p.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST})")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"(default {DEFAULT_PORT})")
    p.add_argument(
        "--api-key",
        default=os.environ.get("LCGEN_API_KEY") or None,  # set but empty: none
        help="require 'Authorization: Bearer KEY' (default: $LCGEN_API_KEY unless empty)",
    )
    p.add_argument("--n-ctx", type=int, default=4096, help="context size in tokens (default 4096)")
    p.add_argument("--n-seq-max", type=int, default=None, help="sequence slots (default 32)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: cores, <= 8)")
    p.add_argument(
        "--max-queue", type=int, default=None, help="most choices waiting before 429 (64)"
    )
    p.add_argument(
        "--draft",
        default=None,
        help="a draft model of the same vocabulary, for requests with speculate: 'draft'",
    )
    p.add_argument("--verbose", action="store_true", help="show llama.cpp's log and requests")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``serve`` to ``lcgen``'s subcommands; its handler is :func:`command`."""
    help_text = "serve the model over an OpenAI-compatible HTTP API"
    p: argparse.ArgumentParser = subparsers.add_parser(
        "serve", help=help_text, description=help_text
    )
    add_arguments(p)
    p.set_defaults(func=command)
    return p


def command(args: argparse.Namespace) -> int:
    """Run ``serve`` with parsed arguments; returns the exit status."""
    serve(
        args.model,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        n_ctx=args.n_ctx,
        n_seq_max=args.n_seq_max,
        threads=args.threads,
        max_queue=args.max_queue,
        draft=args.draft,
        verbose=args.verbose,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m lcgen.server MODEL [options]``; returns the exit status."""
    p = Parser(prog="python -m lcgen.server", description=__doc__.split("\n")[0])
    add_arguments(p)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return command(args)
    except (lcgen.LcgenError, ValueError, TypeError, OSError) as exc:
        print(f"lcgen serve: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


__all__ = [
    "Parser",
    "ServerExtraMissingError",
    "add_parser",
    "command",
    "main",
    "require_extra",
    "serve",
]
