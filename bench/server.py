"""The server rows: ``lcgen serve`` under concurrent clients, against llama-cpp-python's server.

Both servers run as subprocesses on 127.0.0.1 (``python -m lcgen.server`` and ``python -m
llama_cpp.server``) on the same model file, context size and thread count; the clients are
threads of this process using the official ``openai`` client, streaming, greedy, with the
end-of-generation tokens banned (``logit_bias`` -100) so every reply has exactly its tokens.

- ``server-concurrent``: 8 clients at once, each asking for 128 tokens of its own prompt:
  total tokens/s on each server, and lcgen's time to first token (p50, p95) under that load.
- ``server-shared-prompt``: 8 clients whose chats share a system prompt of about 1,000 tokens
  (each adds its own question) against lcgen: client 1 alone first, then clients 2-8 at once;
  the prompt tokens decoded (prompt minus cached, from ``usage``) against one client's prompt,
  and the time to first token of clients 2-8 (median) against client 1's.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp

from bench.harness import Bench, Check, Row, RowFactory, SkipRow, at_least, at_most
from bench.runners import PROSE, Sample, Workload, extra_cpu_buffers

N_CLIENTS = 8
NEW_TOKENS = 128
SHARED_TOKENS = 1000
CONCURRENT_MIN_RATIO = 3.0
SHARED_MAX_DECODED = 1.5  # prompt tokens decoded for 8 clients, in one client's prompts
ROOT = Path(__file__).resolve().parent.parent


def _check_installed() -> None:
    for name in ("openai", "starlette", "uvicorn", "sse_starlette", "fastapi"):
        if importlib.util.find_spec(name) is None:
            raise SkipRow(f"{name} is not installed: pip install -e '.[test]'")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class _Server:
    """A server subprocess and the ``openai`` client that talks to it."""

    proc: subprocess.Popen[bytes]
    url: str
    model: str

    @classmethod
    def start(cls, args: list[str], port: int, model: str) -> _Server:
        # The repository first, then whatever path the bench itself was given.
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path}
        with tempfile.TemporaryFile() as log:  # its stderr, shown if it does not start
            proc = subprocess.Popen([sys.executable, "-m", *args], env=env, stderr=log)
            server = cls(proc, f"http://127.0.0.1:{port}", model)
            deadline = time.monotonic() + 120
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    server.close()
                    log.seek(0)
                    tail = log.read().decode(errors="replace")[-2000:]
                    raise RuntimeError(f"the server {' '.join(args[:1])} did not start:\n{tail}")
                with contextlib.suppress(OSError):
                    urllib.request.urlopen(server.url + "/v1/models", timeout=5).close()
                    return server
                time.sleep(0.2)

    def client(self) -> Any:
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="bench", max_retries=0)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def lcgen_server(path: Path, threads: int, n_ctx: int, extra_buffers: bool) -> _Server:
    port = _free_port()
    args = ["lcgen.server", str(path), "--port", str(port), "--threads", str(threads)]
    return _Server.start([*args, "--n-ctx", str(n_ctx)], port, path.name)


def llama_cpp_server(path: Path, threads: int, n_ctx: int, extra_buffers: bool) -> _Server:
    port = _free_port()
    # Through this module's main: it loads the model with the CPU buffers lcgen uses.
    args = ["bench.server", str(int(extra_buffers)), "--model", str(path), "--port", str(port)]
    args += ["--host", "127.0.0.1"]
    args += ["--n_threads", str(threads), "--n_threads_batch", str(threads)]
    # Its default ends a running stream when the next request comes: let each one finish.
    args += ["--interrupt_requests", "False"]
    if llama_cpp.llama_supports_gpu_offload():
        args += ["--n_gpu_layers", "-1"]  # every layer, as lcgen serve does (its default is 0)
    return _Server.start([*args, "--n_ctx", str(n_ctx)], port, str(path))


@dataclass(frozen=True, slots=True)
class _Reply:
    start: float
    first: float  # when the first text arrived
    end: float
    usage: Any


def _stream_chat(
    server: _Server, client: Any, messages: list[dict[str, str]], work: Workload, n: int
) -> _Reply:
    """One greedy streamed chat of ``n`` tokens (end of generation banned), through ``client``
    (made beforehand: making one takes 20-170 ms, more with several threads at once, which is
    the client's cost, not the server's)."""
    bias = {str(token): -100 for token in work.banned}
    start = time.perf_counter()
    first = 0.0
    usage = None
    stream = client.chat.completions.create(
        model=server.model,
        messages=messages,
        max_tokens=n,
        temperature=0,
        logit_bias=bias,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and not first:
            first = time.perf_counter()
        usage = chunk.usage or usage
    return _Reply(start, first or time.perf_counter(), time.perf_counter(), usage)


def _at_once(calls: Sequence[Callable[[], _Reply]]) -> list[_Reply]:
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [f.result() for f in futures]


class _Servers:
    """Started on first use, stopped when the row closes."""

    def __init__(self, make: dict[str, Callable[[Path, int, int, bool], _Server]]) -> None:
        self.make = make
        self.running: dict[str, _Server] = {}

    def get(self, bench: Bench, name: str) -> _Server:
        if name not in self.running:
            cfg = bench.llama_cpp_python.cfg
            path = bench.lcgen.model.path
            server = self.make[name](path, cfg.n_threads, cfg.n_ctx, cfg.extra_cpu_buffers)
            self.running[name] = server
        return self.running[name]

    def close(self) -> None:
        for server in self.running.values():
            server.close()
        self.running.clear()


def _user(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Tell story number {i} about {PROSE[:200]}"}]


# 8 clients x 128 tokens ----------------------------------------------------------------------
def concurrent_row(work: Workload) -> Row:
    _check_installed()
    servers = _Servers({"lcgen serve": lcgen_server, "llama-cpp-python server": llama_cpp_server})
    n_new = min(NEW_TOKENS, work.n_tokens)

    def run(bench: Bench, r: int) -> dict[str, Sample]:
        out: dict[str, Sample] = {}
        names = list(servers.make) if r % 2 == 0 else list(reversed(servers.make))
        for name in names:
            server = servers.get(bench, name)
            calls = [
                functools.partial(
                    _stream_chat, server, server.client(), _user(100 * r + i), work, n_new
                )
                for i in range(N_CLIENTS)
            ]
            replies = _at_once(calls)
            seconds = max(x.end for x in replies) - min(x.start for x in replies)
            out[name] = Sample(seconds, N_CLIENTS * n_new)
            if name == "lcgen serve":
                if any(x.usage.completion_tokens != n_new for x in replies):
                    raise RuntimeError("lcgen serve made other than the tokens asked for")
                ttft = sorted(x.first - x.start for x in replies)
                out["lcgen TTFT p50"] = Sample(statistics.median(ttft), 1)
                out["lcgen TTFT p95"] = Sample(ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))], 1)
        return out

    return Row(
        "server-concurrent",
        f"{N_CLIENTS} clients at once, each streaming a greedy chat reply of {n_new} tokens to "
        "its own prompt, against `python -m lcgen.server` and `python -m llama_cpp.server` (same "
        "model, n_ctx and threads); total tokens/s from the first request to the last reply, "
        "and lcgen's time to first token under that load",
        {
            "lcgen serve": "tokens/s",
            "llama-cpp-python server": "tokens/s",
            "lcgen TTFT p50": "ms",
            "lcgen TTFT p95": "ms",
        },
        run,
        (Check("lcgen serve", "llama-cpp-python server", at_least(CONCURRENT_MIN_RATIO)),),
        close=servers.close,
    )


# a shared system prompt -------------------------------------------------------------------------
def shared_prompt_row(work: Workload) -> Row:
    _check_installed()
    servers = _Servers({"lcgen serve": lcgen_server})
    n_shared = min(SHARED_TOKENS, 8 * len(work.prompt))

    def run(bench: Bench, r: int) -> dict[str, Sample]:
        server = servers.get(bench, "lcgen serve")
        model = bench.lcgen.model
        system, text = "", f"Round {r}. "
        while len(model.tokenize(system)) < n_shared:
            system, text = system + text, PROSE
        chats = [
            [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}?"}]
            for i in range(N_CLIENTS)
        ]
        first = _stream_chat(server, server.client(), chats[0], work, 4)
        rest = _at_once(
            [
                functools.partial(_stream_chat, server, server.client(), c, work, 4)
                for c in chats[1:]
            ]
        )
        replies = [first, *rest]
        decoded = sum(
            x.usage.prompt_tokens - x.usage.prompt_tokens_details.cached_tokens for x in replies
        )
        return {
            "prompt tokens decoded": Sample(1.0, decoded),
            "one client's prompt": Sample(1.0, first.usage.prompt_tokens),
            "TTFT client 1": Sample(first.first - first.start, 1),
            "TTFT clients 2-8": Sample(statistics.median(x.first - x.start for x in rest), 1),
        }

    return Row(
        "server-shared-prompt",
        f"{N_CLIENTS} clients whose chats share a system prompt of about {n_shared} tokens, each "
        "with its own question, against `python -m lcgen.server`: client 1 alone, then clients "
        "2-8 at once; the prompt tokens decoded for all (prompt minus cached, from usage) "
        "against one client's prompt, and the time to first token of clients 2-8 (median) "
        "against client 1's",
        {
            "prompt tokens decoded": "count",
            "one client's prompt": "count",
            "TTFT client 1": "ms",
            "TTFT clients 2-8": "ms",
        },
        run,
        (
            Check("prompt tokens decoded", "one client's prompt", at_most(SHARED_MAX_DECODED)),
            Check("TTFT client 1", "TTFT clients 2-8", at_least(1.0)),
        ),
        close=servers.close,
    )


FACTORIES: dict[str, RowFactory] = {
    "server-concurrent": concurrent_row,
    "server-shared-prompt": shared_prompt_row,
}


def _serve_llama_cpp(argv: list[str]) -> None:
    """``python -m bench.server EXTRA_BUFFERS ARGS``: llama-cpp-python's server with ARGS, its
    model loaded with llama.cpp's extra CPU buffers on (1) or off (0), as lcgen loads it
    (``Llama`` takes no such option; lcgen turns them off where AMX crashes)."""
    from llama_cpp.server.__main__ import main

    sys.argv = ["llama_cpp.server", *argv[1:]]
    with extra_cpu_buffers(argv[0] == "1"):
        main()  # type: ignore[no-untyped-call]


if __name__ == "__main__":
    _serve_llama_cpp(sys.argv[1:])
