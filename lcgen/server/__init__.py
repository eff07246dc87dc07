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
import errno
import functools
import importlib.util
import os
import socket
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

import lcgen
from lcgen.server.requests import check_api_key, check_cors_origins

if TYPE_CHECKING:
    import uvicorn

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
_EXTRA = ("starlette", "uvicorn", "sse_starlette")


class ServerExtraMissingError(lcgen.LcgenError, ImportError):
    """The server's dependencies are not installed (``pip install 'lcgen[server]'``)."""


class ServerAddressError(lcgen.LcgenError, OSError):
    """The server cannot listen on its host and port (another server has it, or the address
    is not this machine's)."""


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
    type_k: str = "f16",
    type_v: str = "f16",
    verbose: bool = False,
    cors_origins: Sequence[str] = (),
) -> None:
    """Load a model and serve it until interrupted (Ctrl-C, SIGTERM); requests still running
    then end at once (503 ``shutting_down``; a stream: an error event and ``[DONE]``).

    The address is bound before the model loads, so a port in use fails at once; one line on
    stderr says when the server is ready (``lcgen serve: MODEL on http://HOST:PORT ...``).

    Args:
        model_name_or_path: a registry name, ``.gguf`` path or ``hf:`` reference.
        host: the address to bind (127.0.0.1: this machine only).
        port: the TCP port (0: any free one, named in the ready line).
        api_key: when set, requests need ``Authorization: Bearer KEY`` (not ``/health``).
        n_ctx: the context size in tokens, shared by all running requests.
        n_seq_max: sequence slots: requests (choices) running at once, and cached prefixes.
        threads: CPU threads, fixed (None: adapts to the load, at most the cores, <= 8).
        max_queue: the most choices waiting for a slot before requests get 429, at least 1
            (None: 64).
        draft: a draft model (same vocabulary) for requests with ``speculate: "draft"``.
        type_k, type_v: the KV cache's element types (see :class:`lcgen.Model`; ``"auto"``
            values: bf16 on a CPU, faster on some CPUs and slower on others).
        verbose: show llama.cpp's log and every request.
        cors_origins: web origins whose pages may call the API from a browser (``*``: any;
            see :func:`lcgen.server.app.create_app`).

    Raises:
        ServerExtraMissingError: the server's dependencies are not installed.
        ValueError: ``api_key`` is blank, ``port`` is not in 0-65535, ``max_queue`` is
            below 1 or a CORS origin is not one (before anything is bound or loaded).
        ServerAddressError: ``host:port`` cannot be bound (in use, or not this machine's).
        ModelNotFoundError, ModelLoadError: the model cannot be found or loaded.
    """
    require_extra()
    import uvicorn

    from lcgen.server.app import DEFAULT_MAX_QUEUE, create_app

    check_api_key(api_key)
    cors_origins = check_cors_origins(cors_origins)
    _check_port(port)
    if max_queue is not None:
        _check_max_queue(max_queue)
    ref = str(model_name_or_path)
    # The name clients give: a registry name as given, a file by its name (no directories).
    name = Path(ref).name if ref.endswith(".gguf") else ref
    load = functools.partial(
        lcgen.load,
        n_ctx=n_ctx,
        n_seq_max=n_seq_max,
        n_threads=threads,
        type_k=type_k,
        type_v=type_v,
        verbose=verbose,
    )
    with contextlib.ExitStack() as stack:
        sock = stack.enter_context(_bind(host, port))
        model = stack.enter_context(load(ref))
        draft_model = None if draft is None else stack.enter_context(load(draft))
        app = create_app(
            model,
            model_name=name,
            api_key=api_key,
            max_queue=DEFAULT_MAX_QUEUE if max_queue is None else max_queue,
            draft_model=draft_model,
            cors_origins=cors_origins,
        )
        config = uvicorn.Config(
            app, host=host, port=port, log_level="info" if verbose else "warning"
        )
        try:  # another server may have bound the port too, and listened first
            sock.listen(config.backlog)
        except OSError as exc:
            raise _address_error(host, port, exc) from None
        ready = f"lcgen serve: {name} on {_url(host, sock)} (OpenAI API at /v1)"
        server = _ready_server(config, ready, app.state.engine.close)
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: uvicorn stopped, as uvicorn.run
            server.run(sockets=[sock])


def _ready_server(
    config: uvicorn.Config, ready: str, stop_requests: Callable[[], None]
) -> uvicorn.Server:
    """uvicorn's server, saying ``ready`` on stderr once it listens, and calling
    ``stop_requests`` (in a thread) as it begins to shut down."""
    import asyncio

    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                print(ready, file=sys.stderr, flush=True)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            # uvicorn waits for running requests: a long generation kept Ctrl-C from stopping
            # the server, silently, for minutes. They end now (503 shutting_down).
            await asyncio.to_thread(stop_requests)
            await super().shutdown(sockets=sockets)
            ended = getattr(self.lifespan, "shutdown_event", None)
            if ended is not None and not ended.is_set():
                # A second Ctrl-C: uvicorn skips the app's own shutdown, whose task then dies
                # cancelled with the loop (a traceback logged as an error). The requests are
                # stopped already: it ends at once.
                await self.lifespan.shutdown()

    return Server(config)


def _api_key_arg(text: str) -> str:
    """An argparse type: a key that is not blank (given, or from ``$LCGEN_API_KEY``)."""
    try:
        check_api_key(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            "the API key is blank: any client could send it; give a key, or leave out "
            "--api-key and LCGEN_API_KEY (or set it empty) for a server without authentication"
        ) from None
    return text


def _check_port(port: int) -> int:
    """``port`` when it is a TCP port number (0-65535; 0 picks a free one).

    Raises:
        ValueError: it is not (the value is named).
    """
    if not 0 <= port <= 65535:
        raise ValueError(f"the port must be in 0-65535, got {port}")
    return port


def _check_max_queue(max_queue: int) -> int:
    """``max_queue`` when it is at least 1 (a server with no queue refuses every request that
    finds the slots busy).

    Raises:
        ValueError: it is below 1 (the value is named).
    """
    if max_queue < 1:
        raise ValueError(f"the queue must hold at least 1 choice, got {max_queue}")
    return max_queue


def _bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port``, not yet listening (connections are refused, not
    kept waiting, while the model loads).

    Raises:
        ServerAddressError: the address cannot be bound (the host and port are named).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn binds
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise _address_error(host, port, exc) from None
    return sock


def _address_error(host: str, port: int, exc: OSError) -> ServerAddressError:
    reason = exc.strerror or str(exc)
    if exc.errno == errno.EADDRINUSE:
        reason += " (another server listens there: --port picks another port)"
    return ServerAddressError(f"cannot listen on {host}:{port}: {reason}")


def _url(host: str, sock: socket.socket) -> str:
    port = sock.getsockname()[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


# command line ------------------------------------------------------------------------------
class Parser(argparse.ArgumentParser):
    """The parser of lcgen's commands (``lcgen``, ``python -m lcgen.server``): a usage error (an
    unknown flag, a bad value, a missing argument) is one line on stderr, status 2, as lcgen's
    other errors are one line."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def _print_message(self, message: str, file: Any = None) -> None:
        # argparse drops a write that fails: `--help > /dev/full` exited 0, the help lost.
        # Output on stdout (the help, the version) raises instead; messages on stderr do not.
        if message and file is not None and file is sys.stdout:
            file.write(message)
            file.flush()
            return
        super()._print_message(message, file)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The model and how it loads, as every ``lcgen`` command that loads one takes them: its
    reference, ``--n-ctx``, ``--threads`` and the KV cache's element types."""
    p.add_argument(
        "model", help="registry name (see `lcgen models`), .gguf path or hf:org/repo/file"
    )
    p.add_argument(
        "--n-ctx",
        type=int_in(0, 2**31 - 1),
        default=4096,
        help="context size in tokens (default 4096; 0: the model's training context)",
    )
    add_threads_argument(p)
    p.add_argument(
        "--cache-type-k",
        choices=lcgen.KV_CACHE_TYPES,
        default="f16",
        help="the KV cache's element type for keys (default f16)",
    )
    p.add_argument(
        "--cache-type-v",
        choices=("auto", *lcgen.KV_CACHE_TYPES),
        default="f16",
        help="the KV cache's element type for values (default f16; auto: bf16 on a CPU, "
        "which decodes faster on some CPUs and slower on others and prefills slower, f16 on a "
        "GPU)",
    )


def add_threads_argument(p: argparse.ArgumentParser) -> None:
    """``--threads`` (lcgen.load's n_threads)."""
    p.add_argument(
        "--threads",
        type=int_in(1, 512),
        default=None,
        help="CPU threads, fixed (default: adapts to the load, at most the cores, <= 8)",
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The server's options on a parser (``lcgen serve`` and ``python -m lcgen.server``)."""
    add_model_arguments(p)
    p.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST})")
    p.add_argument(
        "--port",
        type=_int_arg(_check_port),
        default=DEFAULT_PORT,
        help=f"0-65535; 0 picks a free one (default {DEFAULT_PORT})",
    )
    p.add_argument(
        "--api-key",
        type=_api_key_arg,
        default=os.environ.get("LCGEN_API_KEY") or None,  # set but empty: none
        help="require 'Authorization: Bearer KEY' (default: $LCGEN_API_KEY unless empty)",
    )
    p.add_argument(
        "--n-seq-max",
        type=int_in(1, 256),
        default=None,
        help="sequence slots, 1-256 (default 32)",
    )
    p.add_argument(
        "--max-queue",
        type=_int_arg(_check_max_queue),
        default=None,
        help="most choices waiting before 429, at least 1 (default 64)",
    )
    p.add_argument(
        "--draft",
        default=None,
        help="a draft model of the same vocabulary, for requests with speculate: 'draft'",
    )
    p.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let web pages of ORIGIN (https://host:port; '*': any) call the API from a "
        "browser; repeatable (default: none)",
    )
    p.add_argument("--verbose", action="store_true", help="show llama.cpp's log and requests")


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an int in [low, high] (out of range: a usage error, status 2)."""
    return _int_arg(_in_range(low, high))


def _in_range(low: int, high: int) -> Callable[[int], int]:
    """A check for :func:`_int_arg`: an int in [low, high] (what lcgen.load accepts)."""

    def check(value: int) -> int:
        if not low <= value <= high:
            raise ValueError(f"must be in [{low}, {high}], got {value}")
        return value

    return check


def _int_arg(check: Callable[[int], int]) -> Callable[[str], int]:
    """An argparse type: an int that ``check`` accepts; its ValueError is the usage error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        try:
            return check(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``serve`` to ``lcgen``'s subcommands; its handler is :func:`command`."""
    help_text = "serve the model over an OpenAI-compatible HTTP API"
    p: argparse.ArgumentParser = subparsers.add_parser(
        "serve", help=help_text, description=help_text
    )
    add_arguments(p)
    p.set_defaults(func=command)
    return p


@contextlib.contextmanager
def one_line_warnings(prog: str) -> Iterator[None]:
    """Within the block, a warning is one line on stderr, ``PROG: warning: MESSAGE``, as errors
    are (not Python's file, line and line of lcgen's source)."""

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        print(f"{prog}: warning: {message}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def command(args: argparse.Namespace) -> int:
    """Run ``serve`` with parsed arguments; returns the exit status (an error is one line on
    stderr, status 1, or 2 for a usage error, as argparse's; a warning is one line too)."""
    try:  # a usage error as --port's, before anything is bound or loaded
        check_cors_origins(args.cors_origin)
    except ValueError as exc:
        message = f"argument --cors-origin: {exc} (see lcgen serve --help)"
        print(f"lcgen serve: error: {message}", file=sys.stderr)
        return 2
    try:
        with one_line_warnings("lcgen serve"):
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
                type_k=args.cache_type_k,
                type_v=args.cache_type_v,
                verbose=args.verbose,
                cors_origins=args.cors_origin,
            )
    except (lcgen.LcgenError, ValueError, TypeError, OSError) as exc:
        print(f"lcgen serve: error: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m lcgen.server MODEL [options]``, the same as ``lcgen serve``; returns the
    exit status."""
    p = Parser(prog="python -m lcgen.server", description=__doc__.split("\n")[0])
    add_arguments(p)
    try:
        args = p.parse_args(sys.argv[1:] if argv is None else argv)
    except OSError as exc:  # the help could not be written (stdout full or gone)
        print(f"python -m lcgen.server: error: {exc}", file=sys.stderr)
        return 1
    try:
        return command(args)
    except KeyboardInterrupt:  # while the model loads
        return 130


__all__ = [
    "Parser",
    "ServerAddressError",
    "ServerExtraMissingError",
    "add_parser",
    "check_api_key",
    "command",
    "main",
    "one_line_warnings",
    "require_extra",
    "serve",
]
