"""The ``lcgen`` command: generate, chat, models, info, demo."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from pathlib import Path
from typing import Any, cast
from urllib.parse import unquote, urljoin, urlsplit
from urllib.request import url2pathname

import lcgen
from lcgen import server
from lcgen._files import MAX_FILE_BYTES, read_bounded
from lcgen.decoding import Chunk, Text
from lcgen.decoding.options import DEFAULT_MAX_RETRIES
from lcgen.decoding.results import check_complete
from lcgen.errors import (
    ContextFullError,
    GrammarError,
    IncompleteOutputError,
    LcgenError,
    StateFileError,
)
from lcgen.runtime.sequence import chunks_of
from lcgen.runtime.statefile import write_atomic

Message = dict[str, str]

#: The exit status after stdout was closed early (``lcgen generate ... | head``): 128 + SIGPIPE,
#: what a shell reports for a Unix tool stopped by that signal.
EXIT_BROKEN_PIPE = 141
CHAT_FILE = (b"", "chat")  # /save's messages file: JSON text, no magic (for write_atomic)
CHAT_MAX_TOKENS = 512  # a chat reply's default most tokens (at most half the context)


class UsageError(ValueError):
    """An error in the options given (out of range, in conflict, a constraint or a file named
    that cannot be used), found before generating: status 2, as argparse's own usage errors."""


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """The model and how to load it."""
    server.add_model_arguments(p)
    p.add_argument(
        "--gpu-layers",
        type=server.int_in(-1, 2**31 - 1),
        default=None,
        help="layers to offload to GPU/Metal (default: all when available)",
    )
    p.add_argument("--verbose", action="store_true", help="show llama.cpp's log")


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int | None) -> None:
    """Sampling flags; ``max_tokens`` None: a chat's reply, at most half the context."""
    p.add_argument(
        "--max-tokens",
        type=int,
        default=max_tokens,
        help=f"most tokens to generate (default {max_tokens})"
        if max_tokens is not None
        else f"most tokens a reply has (default {CHAT_MAX_TOKENS}, at most half the context)",
    )
    p.add_argument("--temperature", type=finite_float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=finite_float, default=None)
    p.add_argument("--min-p", type=finite_float, default=None)
    p.add_argument("--repeat-penalty", type=finite_float, default=None)
    p.add_argument(
        "--frequency-penalty", type=finite_float, default=None, help="OpenAI's, per occurrence"
    )
    p.add_argument(
        "--presence-penalty", type=finite_float, default=None, help="OpenAI's, once per token"
    )
    p.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    p.add_argument(
        "--token-healing",
        action="store_true",
        help="let the first token re-tokenize the end of the prompt",
    )
    p.add_argument(
        "--stop",
        action="append",
        default=None,
        help=r"stop string (repeatable); text stops before it; \n, \t and \\ are escapes",
    )
    p.add_argument(
        "--ban",
        action="append",
        default=None,
        metavar="PHRASE",
        help="phrase the output must not contain (repeatable); generation backs up and retries",
    )
    p.add_argument(
        "--ban-regex",
        action="append",
        default=None,
        metavar="REGEX",
        help="regular expression the output must not match (repeatable; bounded length)",
    )
    p.add_argument(
        "--ban-ignore-case", action="store_true", help="match --ban and --ban-regex in any case"
    )
    p.add_argument(
        "--max-retries",
        type=server.int_in(0, 2**31 - 1),
        default=None,
        help="most rewinds and resamples for banned phrases and a JSON Schema's uniqueItems "
        "(default 64)",
    )
    p.add_argument(
        "--speculate",
        action="store_true",
        help="speculative decoding with drafts from the prompt and the output (same output)",
    )
    p.add_argument(
        "--draft",
        default=None,
        metavar="MODEL",
        help="speculative decoding with a draft model of the same vocabulary (same output)",
    )


def finite_float(text: str) -> float:
    """An argparse type: a finite float (``--temperature inf`` passed the library's checks and
    sampled from a flat distribution; nan and inf are usage errors, status 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def _load(args: argparse.Namespace, ref: str | None = None) -> lcgen.Model:
    """The command's model (or ``ref``, another model loaded with the same settings)."""
    return lcgen.load(
        args.model if ref is None else ref,
        n_ctx=args.n_ctx,
        n_threads=args.threads,
        n_gpu_layers=args.gpu_layers,
        type_k=args.cache_type_k,
        type_v=args.cache_type_v,
        verbose=args.verbose,
    )


def _checked_options(
    args: argparse.Namespace, constraint: lcgen.Grammar | None = None
) -> dict[str, Any]:
    """The generation options given, checked (with the constraint) by making a plan of them,
    before any model loads; a draft model (``--draft``) is not loaded yet: see :func:`_draft`.

    Raises:
        UsageError: an option out of range or in conflict with another, or a text that is not
            UTF-8 (named).
    """
    options = _options(args)
    try:
        for flag in ("--system", "--suffix"):
            _check_text(getattr(args, flag[2:], None) or "", flag)
        lcgen.make_plan(**options, grammar=constraint)
    except (LcgenError, ValueError, TypeError) as exc:
        raise UsageError(_as_flag(str(exc), options, args)) from None
    return options


def _as_flag(message: str, options: dict[str, Any], args: argparse.Namespace) -> str:
    """A message that starts with an option's keyword (``top_p must be in (0, 1], got 2.0``)
    with the flag that sets it instead (``--top-p``): a keyword the command line gives
    under its own name."""
    name, _, rest = message.partition(" ")
    if name in options and name in vars(args):
        return f"--{name.replace('_', '-')} {rest}"
    return message


def _options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "max_tokens": CHAT_MAX_TOKENS if args.max_tokens is None else args.max_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "repeat_penalty": args.repeat_penalty,
        "frequency_penalty": args.frequency_penalty,
        "presence_penalty": args.presence_penalty,
        "seed": args.seed,
        "stop": [unescape(stop) for stop in args.stop] if args.stop else None,
        "token_healing": args.token_healing,
        **_bans(args),
        **_speculation(args),
    }


def _speculation(args: argparse.Namespace) -> dict[str, Any]:
    """--speculate as a generation option (--draft's model is loaded by :func:`_draft`)."""
    if args.speculate and args.draft:
        raise UsageError("give --speculate (drafts from the prompt) or --draft MODEL, not both")
    return {"speculate": "ngram"} if args.speculate else {}


def _draft(args: argparse.Namespace) -> dict[str, Any]:
    """--draft MODEL as a generation option, the draft model loaded (after the model)."""
    return {"speculate": _load(args, args.draft)} if args.draft else {}


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def unescape(text: str) -> str:
    r"""``\n``, ``\t``, ``\r`` and ``\\`` as the characters they name; other backslashes
    stay as they are."""
    return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m.group(1), m.group(0)), text, flags=re.S)


def _bans(args: argparse.Namespace) -> dict[str, Any]:
    """--ban / --ban-regex / --ban-ignore-case / --max-retries as generation options."""
    patterns = []
    flags = re.IGNORECASE if args.ban_ignore_case else 0
    for regex in args.ban_regex or ():
        try:
            patterns.append(re.compile(regex, flags))
        except re.error as exc:
            raise UsageError(f"--ban-regex {regex!r} is not a regular expression: {exc}") from None
    if not args.ban and not patterns:
        if args.ban_ignore_case:
            raise UsageError("--ban-ignore-case needs --ban or --ban-regex")
        if args.max_retries is None:
            return {}
        if getattr(args, "json_schema", None) is None:  # (its uniqueItems retry too)
            raise UsageError("--max-retries needs --ban, --ban-regex or --json-schema")
        return {"max_retries": args.max_retries}
    options: dict[str, Any] = {
        "banned": [*(args.ban or ()), *patterns],
        "banned_ignore_case": args.ban_ignore_case,
    }
    if args.max_retries is not None:
        options["max_retries"] = args.max_retries
    return options


def _print_stream(chunks: Iterable[Chunk]) -> Chunk | None:
    last = None
    for chunk in chunks:
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        last = chunk
    return last


def _constraint(args: argparse.Namespace) -> tuple[str, lcgen.Grammar] | None:
    """The one --grammar / --json-schema / --choice / --regex given: its flag and its grammar
    (None when none is).

    Raises:
        UsageError: more than one, an empty one, or one that cannot be read or compiled (the
            flag and its value named).
    """
    given = [
        name
        for name in ("grammar", "json_schema", "choice", "regex")
        if getattr(args, name) is not None
    ]
    for name in given:
        if not getattr(args, name):
            raise UsageError(f"--{name.replace('_', '-')} is empty: give a value or leave it out")
    if len(given) > 1:
        raise UsageError(
            f"give at most one of --grammar, --json-schema, --choice, --regex; got {given}"
        )
    if not given:
        return None
    name = given[0]
    value: str = getattr(args, name)
    flag = f"--{name.replace('_', '-')}"
    # A file or a bundled grammar's name as given, a regex or choices quoted, GBNF text unshown.
    shown = repr(value) if name in {"choice", "regex"} else value
    where = flag if name == "grammar" and "::=" in value else f"{flag} {shown}"
    try:
        if name == "grammar":
            return flag, _grammar(value)
        if name == "json_schema":
            schema = _schema(Path(value))
            documents = _beside(Path(value), schema)
            uri = Path(value).resolve().as_uri()
            return flag, lcgen.Grammar.from_json_schema(schema, documents=documents, uri=uri)
        if name == "choice":
            return flag, lcgen.Grammar.choice(value.split(","))
        return flag, lcgen.Grammar.regex(value)
    except (LcgenError, ValueError, TypeError, OSError) as exc:
        raise UsageError(f"{where}: {_reason(exc)}") from None


def read_file(path: Path) -> str:
    """The UTF-8 text of a file an option or a chat command names (see
    :func:`lcgen._files.read_bounded`: a pipe is read too, a device or a socket is not).

    Raises:
        OSError: the file cannot be read (a directory: ``IsADirectoryError``).
        ValueError: it is a device or a socket, or over the bound (the bound named);
            ``UnicodeDecodeError``: it is not UTF-8 text.
    """
    return read_bounded(path).decode("utf-8")


def _schema(path: Path) -> dict[str, Any] | bool:
    """The JSON Schema in a file.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not JSON, or the JSON is not a schema (an object, true or false), or
            the file is not a file or too large (see :func:`read_file`).
    """
    try:
        schema = json.loads(read_file(path))
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc}") from None
    except RecursionError:
        raise ValueError("the JSON nests too deeply to read") from None
    if not isinstance(schema, dict | bool):
        raise ValueError(
            "a JSON Schema is an object (or true or false), the file holds "
            f"{json.dumps(schema)[:80]}"
        )
    return schema


def _beside(path: Path, schema: dict[str, Any] | bool) -> Callable[[str], Any]:
    """The documents a schema file's references name, read from the regular files beside it
    (references resolve against the file's ``file:`` URI where the schema's ``$id`` is none or
    relative): any file where the schema has no absolute ``$id``, else one in the folder of
    that ``$id`` or below (a path from the file's folder). Another, or a file that cannot be
    read, is a :class:`GrammarError`, raised where the schema uses it."""
    ident = schema.get("$id", schema.get("id")) if isinstance(schema, dict) else None
    folder = urljoin(ident, ".") if isinstance(ident, str) and urlsplit(ident).scheme else ""
    if folder.startswith("file:"):  # (an $id that names files names these ones)
        folder = ""

    def document(uri: str) -> Any:
        if folder:
            relative = unquote(uri[len(folder) :]) if uri.startswith(folder) else ""
            bad = not relative or urlsplit(relative).scheme or relative.startswith("/")
            file = None if bad or ".." in relative.split("/") else path.parent / relative
        else:
            parts = urlsplit(uri)
            file = Path(url2pathname(parts.path)) if parts.scheme == "file" else None
        if file is None:
            where = f"the folder of its $id ({folder}) or below" if folder else "files"
            raise GrammarError(
                f"the document {uri!r} is no file beside the schema file: the command line "
                f"reads those only ({where})"
            )
        try:
            if file.exists() and not file.is_file():  # (a pipe would wait for a writer)
                raise ValueError("not a regular file")
            return _schema(file)
        except (OSError, ValueError) as exc:  # (said where the schema uses it)
            raise GrammarError(f"{file} (the document {uri!r}): {_reason(exc)}") from None

    return document


def _reason(exc: BaseException) -> str:
    """An exception's message; for a file that cannot be read, without the file name that the
    message names already (``[Errno 2] No such file or directory: 'x'``)."""
    if isinstance(exc, OSError) and exc.strerror and exc.filename is not None:
        return exc.strerror
    if isinstance(exc, UnicodeDecodeError):
        return f"not UTF-8 text ({exc.reason} at byte {exc.start})"
    return str(exc)


def _grammar(text: str) -> lcgen.Grammar:
    """--grammar: inline GBNF (text with a ``::=`` rule), else a file that is there (read with
    :func:`read_file`'s bound and checks), else :meth:`lcgen.Grammar.from_file` (a bundled
    name, or the error that says what is missing)."""
    if "::=" in text:
        return lcgen.Grammar(text)
    path = Path(text)
    if path.exists() and not path.is_dir():
        return lcgen.Grammar(read_file(path))
    return lcgen.Grammar.from_file(text)


def _prompt(args: argparse.Namespace) -> str:
    """The prompt text (``-`` reads stdin, without its final newline), checked with the options
    that shape it.

    Raises:
        UsageError: --system without --chat, --suffix with --chat, or an empty prompt (where
            nothing else would be in the sequence).
    """
    if args.system is not None and not args.chat:
        raise UsageError("--system needs --chat (it is the chat's system message)")
    if args.suffix is not None and args.chat:
        raise UsageError("--suffix fills in the middle of text: it does not take --chat")
    prompt: str = args.prompt
    if prompt == "-":
        prompt = _read_stdin().removesuffix("\n")
    if not prompt and not args.chat and args.suffix is None:
        source = "stdin held no text" if args.prompt == "-" else "give the text to continue"
        raise UsageError(f"the prompt is empty: {source}")
    try:
        _check_text(prompt, "the prompt")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return prompt


def _read_stdin() -> str:
    """stdin's text, at most :data:`~lcgen._files.MAX_FILE_BYTES` bytes of it (as UTF-8):
    ``- < /dev/zero`` grew without bound until the process was killed.

    Raises:
        UsageError: stdin holds more (the bound named).
    """
    _tolerant_stdin()
    return _bounded(sys.stdin.read(MAX_FILE_BYTES + 1), "the prompt on stdin")


def _bounded(text: str, what: str) -> str:
    """``text``, read as at most ``MAX_FILE_BYTES + 1`` characters, checked to be at most
    :data:`~lcgen._files.MAX_FILE_BYTES` bytes (a character is up to 4).

    Raises:
        UsageError: it is longer (the bound named).
    """
    if len(text) > MAX_FILE_BYTES // 4 and (
        len(text) > MAX_FILE_BYTES or len(text.encode("utf-8", "surrogateescape")) > MAX_FILE_BYTES
    ):
        raise UsageError(f"{what} is over {MAX_FILE_BYTES // 2**20} MiB, the most lcgen reads")
    return text


def _tolerant_stdin() -> None:
    """Read stdin without failing on a byte that is not text: Python's strict decoding (in most
    UTF-8 locales) raised while reading, which ended a chat; :func:`_check_text` names the byte."""
    if isinstance(sys.stdin, io.TextIOWrapper):
        sys.stdin.reconfigure(errors="surrogateescape")


def _check_text(text: str, what: str) -> None:
    """Check that ``text`` (an argument, or stdin as :func:`_tolerant_stdin` reads it) holds no
    byte that was not text: Python keeps such a byte as a lone surrogate.

    Raises:
        ValueError: it does (the first byte and where it is named).
    """
    bad = re.search("[\udc80-\udcff]", text)
    if bad:
        raise ValueError(
            f"{what} is not UTF-8 text (the byte 0x{ord(bad[0]) - 0xDC00:02x} at character "
            f"{bad.start()}): convert it to UTF-8"
        )


def _prompt_tokens(model: lcgen.Model, args: argparse.Namespace, prompt: str) -> list[int]:
    """The prompt's tokens: through the chat template with ``--chat``, around the suffix with
    ``--suffix``."""
    if args.suffix is not None:
        return model.infill_tokens(prompt, args.suffix)
    if not args.chat:
        return model.tokenize(prompt)
    _check_chat_template(model, "without --chat, the prompt is continued as text")
    messages = [{"role": "system", "content": args.system}] if args.system else []
    return model.chat_tokens([*messages, {"role": "user", "content": prompt}])


def _check_chat_template(model: lcgen.Model, instead: str) -> None:
    """Before a chat: the model has a chat template.

    Raises:
        ValueError: it has none (a base model; ``instead`` says what to do).
    """
    if not model.has_chat_template:
        raise ValueError(f"{model.path.name} has no chat template (a base model): {instead}")


def cmd_generate(args: argparse.Namespace) -> int:
    constraint = _constraint(args)  # the usage errors first, before the model loads
    grammar = constraint[1] if constraint else None
    options = _checked_options(args, grammar)
    prompt = _prompt(args)
    model = _load(args)
    options |= _draft(args)
    tokens = _prompt_tokens(model, args, prompt)
    _check_fits(model, len(tokens), args.max_tokens)
    n_prompt = len(tokens) - model.cache.cached(tokens)  # the tokens the prompt decodes
    timer = _Timer()
    with model.sequence(tokens) as seq:
        run = seq.run(**options, grammar=grammar)
        # The constrained value whole: with the prompt text healing re-creates (its "{" of a
        # JSON object), written with the first chunk (none where the first step fails).
        healed = run.generator.healed if grammar is not None else ""
        chunks = list(timer.each(_tee(chunks_of(run), healed)))
    sys.stdout.write("\n")
    sys.stdout.flush()
    last = chunks[-1] if chunks else None
    if args.verbose and last is not None:
        print(f"[finish_reason={last.finish_reason} {last.stats}]", file=sys.stderr)
    if not args.quiet:
        n_generated = sum(len(chunk.tokens) for chunk in chunks)
        print(timer.summary(n_prompt, n_generated), file=sys.stderr)
    problem = None
    if constraint:
        problem = _incomplete(model, args, constraint, chunks, run.generator.healed)
    if problem:
        print(f"lcgen: error: {problem}", file=sys.stderr)
        return 1
    _note_retries(last, args.max_retries, "output")
    return 0


def _check_fits(model: lcgen.Model, n_prompt: int, max_tokens: int) -> None:
    """The library's check that the prompt and the output fit the context, in the flags' words.

    Raises:
        ContextFullError: they do not (the numbers and what to change are named).
    """
    if n_prompt + max_tokens > model.n_ctx:
        raise ContextFullError(
            f"the prompt's {n_prompt} tokens and --max-tokens {max_tokens} need "
            f"{n_prompt + max_tokens}, over the context of {model.n_ctx} tokens: "
            "shorten the prompt, lower --max-tokens or raise --n-ctx"
        )


def _used_up_retries(max_retries: int | None, banned: bool = True) -> str:
    n = DEFAULT_MAX_RETRIES if max_retries is None else max_retries
    what = "the banned phrases" if banned else "items of a uniqueItems array repeating others"
    return f"{what} used up the retries (--max-retries {n})"


def _note_retries(last: Chunk | None, max_retries: int | None, what: str) -> None:
    """Say on stderr when the banned phrases ended the text early (finish reason "retries")."""
    if last is not None and last.finish_reason == "retries":
        note = f"{_used_up_retries(max_retries)}: the {what} ends early"
        print(f"lcgen: warning: {note}", file=sys.stderr)


class _Timer:
    """When a generation's first and last steps ended: prompt and generation speed."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first = self.last = self.start

    def each(self, chunks: Iterable[Chunk]) -> Iterator[Chunk]:
        for i, chunk in enumerate(chunks):
            self.last = time.perf_counter()
            if i == 0:
                self.first = self.last
            yield chunk

    def summary(self, n_prompt: int, n_generated: int) -> str:
        """One line: the prompt's tokens and speed (the first step: the prompt is decoded and
        the first token sampled), the generated tokens and the speed of those after it."""
        prompt = _rate(n_prompt, self.first - self.start)
        after_first = _rate(n_generated - 1, self.last - self.first)
        return (
            f"lcgen: prompt {n_prompt} tokens, {prompt} | "
            f"generated {n_generated} tokens, {after_first}"
        )


def _rate(n_tokens: int, seconds: float) -> str:
    return f"{n_tokens / seconds:.1f} tokens/s" if n_tokens > 0 and seconds > 0 else "- tokens/s"


def _incomplete(
    model: lcgen.Model,
    args: argparse.Namespace,
    constraint: tuple[str, lcgen.Grammar],
    chunks: list[Chunk],
    healed: str,
) -> str | None:
    """Why a constrained output is not a complete match of its constraint (the library's
    truncation check), in the command's words; None when it is. ``healed``: the prompt's text
    token healing had the output re-create."""
    flag, grammar = constraint
    text = Text.of(chunks)
    try:
        check_complete(text, grammar, model.vocab, healed=healed)
        return None
    except IncompleteOutputError:
        pass
    last = chunks[-1] if chunks else None
    if last is None:
        reason = "nothing was generated"
    elif last.finish_reason == "length":
        reason = f"generation reached --max-tokens {args.max_tokens} (raise it)"
        with contextlib.suppress(GrammarError):
            if grammar.accepts(model.vocab, healed + text):
                return f"the output may be incomplete: {reason} where {flag} allows more"
    elif last.stop:
        reason = f"the stop string {last.stop!r} cut it"
    else:
        reason = _used_up_retries(args.max_retries, bool(args.ban or args.ban_regex))
    return f"the output is incomplete: {reason} before it matched {flag}"


def _tee(chunks: Iterable[Chunk], before: str = "") -> Iterator[Chunk]:
    """The chunks, each written to stdout as it comes (``before`` with the first)."""
    for chunk in chunks:
        sys.stdout.write(before + chunk.text)
        sys.stdout.flush()
        before = ""
        yield chunk


CHAT_HELP = """\
commands:
  /help          this help
  /clear         forget the conversation (the system prompt stays)
  /system TEXT   set the system prompt (/system alone removes it)
  /save FILE     save the conversation to FILE (the messages, as JSON) and FILE.kv (its KV
                 cache, so a resumed chat does not decode the history again)
  /load FILE     resume a conversation saved with /save
  /exit, /quit   end the chat (or Ctrl-D)
Ctrl-C stops a reply; when the conversation outgrows the context, the oldest turns are dropped."""


def cmd_chat(args: argparse.Namespace) -> int:
    options = _checked_options(args)  # before the model loads
    model = _load(args)
    _check_chat_template(model, f"`lcgen generate {args.model} PROMPT` continues a text")
    if args.max_tokens is None:  # not given: a reply leaves room for the conversation
        options["max_tokens"] = min(CHAT_MAX_TOKENS, model.n_ctx // 2)
    elif args.max_tokens >= model.n_ctx:  # every turn would fail
        raise UsageError(
            f"--max-tokens {args.max_tokens} leaves no room for a message in the context of "
            f"{model.n_ctx} tokens: lower it or raise --n-ctx"
        )
    chat = ChatSession(model, options | _draft(args), args.system)
    _tolerant_stdin()
    interactive = sys.stdin.isatty()
    if interactive:
        _enable_line_editing()
        print("lcgen chat: /help lists the commands, Ctrl-D ends the chat", file=sys.stderr)
    while True:
        try:
            line = _read_line(interactive)
        except KeyboardInterrupt:  # at the prompt: drop the line, keep the chat
            print("\nlcgen: /exit or Ctrl-D ends the chat", file=sys.stderr)
            continue
        if line is None or not chat.handle(line):
            # Piped: a script reads the status (a turn that failed went on to the next).
            return 1 if chat.failed and not interactive else 0


def _read_line(interactive: bool) -> str | None:
    """The next line of input without its newline; None at the end of input (Ctrl-D)."""
    if not interactive:  # a line of ``< /dev/zero`` has no end: bounded
        line = _bounded(sys.stdin.readline(MAX_FILE_BYTES + 1), "a line on stdin")
        return line.removesuffix("\n") if line else None
    try:
        return input("> ")
    except EOFError:
        sys.stdout.write("\n")  # leave the terminal on a fresh line
        return None


def _enable_line_editing() -> None:
    with contextlib.suppress(ImportError):  # not on every platform
        import readline  # noqa: F401 -- gives input() editing and history


class ChatSession:
    """One ``lcgen chat`` conversation: its messages, the commands, the replies.

    Args:
        model: the model that replies.
        options: generation options for every reply.
        system: the system prompt, if any.
    """

    def __init__(self, model: lcgen.Model, options: dict[str, Any], system: str | None) -> None:
        self.model = model
        self.options = options
        self.messages: list[Message] = []
        self.failed = False  # whether a line was an error (said on stderr)
        self._commands: dict[str, Callable[[str], None]] = {
            "/help": lambda _: print(CHAT_HELP, file=sys.stderr),
            "/clear": self.clear,
            "/system": self.set_system,
            "/save": self.save,
            "/load": self.load,
        }
        self.set_system(system or "")

    def handle(self, line: str) -> bool:
        """Run a command or answer a message; False when the chat should end."""
        text = line.strip()
        if not text:
            return True
        try:
            _check_text(text, "the line")
        except ValueError as exc:
            self._error(f"lcgen: error: {exc}")
            return True
        name, _, rest = text.partition(" ")
        if name in {"/exit", "/quit"}:
            return False
        command = self._commands.get(name)
        if command is None and name.startswith("/"):
            self._error(f"lcgen: unknown command {name}; /help lists them")
        elif command is not None:
            try:
                command(rest.strip())
            except (LcgenError, ValueError, TypeError, OSError) as exc:
                self._error(f"lcgen: error: {exc}")
        else:
            self.say(line)
        return True

    def say(self, text: str) -> None:
        """Add a user message and stream the reply to stdout."""
        self.messages.append({"role": "user", "content": text})
        try:
            self._fit()
            reply, stopped = self._reply()
        except (LcgenError, ValueError) as exc:  # this turn failed; the chat goes on
            self.messages.pop()
            self._error(f"lcgen: error: {exc}")
            return
        if stopped and not reply:
            self.messages.pop()  # stopped before a word: as if it was never asked
        else:
            self.messages.append({"role": "assistant", "content": reply})

    def _error(self, message: str) -> None:
        self.failed = True
        print(message, file=sys.stderr)

    def _reply(self) -> tuple[str, bool]:
        """The reply, streamed as it comes; Ctrl-C stops it: ``(text so far, True)``."""
        parts: list[str] = []
        stopped = False
        chunks = cast(
            Generator[Chunk, None, None], self.model.chat_stream(self.messages, **self.options)
        )
        last = None
        try:
            for last in chunks:
                sys.stdout.write(last.text)
                sys.stdout.flush()
                parts.append(last.text)
        except KeyboardInterrupt:
            chunks.close()  # the sequence closes and keeps its cells in the cache
            stopped = True
        finally:
            sys.stdout.write("\n")  # the reply's line ends, whatever ended it
            sys.stdout.flush()
        if stopped:
            print("lcgen: reply stopped (Ctrl-C); /exit or Ctrl-D ends the chat", file=sys.stderr)
        else:
            _note_retries(last, self.options.get("max_retries"), "reply")
        return "".join(parts), stopped

    def _fit(self) -> None:
        """Drop the oldest turns until the prompt and the reply fit the context."""
        budget = self.model.n_ctx - int(self.options.get("max_tokens") or 0)
        self.messages, dropped = fit_history(
            self.messages, lambda m: len(self.model.chat_tokens(m)), budget
        )
        if dropped:
            print(
                f"lcgen: the conversation outgrew the context ({self.model.n_ctx} tokens with "
                f"{self.options.get('max_tokens')} for the reply): dropped the oldest "
                f"{dropped} messages",
                file=sys.stderr,
            )

    # commands -------------------------------------------------------------------------
    def clear(self, _: str = "") -> None:
        self.messages = [m for m in self.messages if m["role"] == "system"]

    def set_system(self, text: str) -> None:
        rest = [m for m in self.messages if m["role"] != "system"]
        self.messages = [{"role": "system", "content": text}, *rest] if text else rest

    def save(self, path: str) -> None:
        """The messages as JSON in ``path``, the model's KV cache in ``path.kv``."""
        if not path:
            raise ValueError("/save needs a file name")
        path = os.path.expanduser(path)  # as a shell would: /save ~/notes/chat.json
        data = {"lcgen_chat": 1, "model": self.model.path.name, "messages": self.messages}
        text = json.dumps(data, ensure_ascii=False, indent=1)
        # Both written atomically: a crash or a full disk leaves the earlier save whole. A
        # missing folder or no permission is a StateFileError naming the file.
        write_atomic(path, text.encode("utf-8"), CHAT_FILE)
        try:
            self.model.cache.save(path + ".kv")
        except StateFileError as exc:  # the messages are saved: say so (a /load decodes them)
            raise StateFileError(
                f"saved {len(self.messages)} messages to {path}, but not the KV cache: {exc}"
            ) from None
        print(f"lcgen: saved {len(self.messages)} messages to {path}", file=sys.stderr)

    def load(self, path: str) -> None:
        """Resume a conversation from :meth:`save`'s files (the KV cache when it matches)."""
        if not path:
            raise ValueError("/load needs a file name")
        path = os.path.expanduser(path)
        try:
            messages = load_messages(Path(path))
        except OSError as exc:  # no such file, no permission: the file named
            raise ValueError(f"/load {exc.filename or path}: {_reason(exc)}") from None
        try:  # messages the chat cannot take leave the conversation as it was
            tokens = self.model.chat_tokens(messages) if messages else []
        except (ValueError, TypeError, LcgenError) as exc:
            raise ValueError(f"/load {path}: {exc}") from None
        self.messages = messages
        note = "no KV cache file: the history is decoded at the next turn"
        if Path(path + ".kv").exists():
            try:
                self.model.cache.load(path + ".kv")
                note = f"{self.model.cache.cached(tokens)} of its {len(tokens)} tokens cached"
            except LcgenError as exc:
                note = f"its KV cache was not restored ({exc})"
        print(f"lcgen: loaded {len(self.messages)} messages from {path}; {note}", file=sys.stderr)


def fit_history(
    messages: list[Message], n_tokens: Callable[[list[Message]], int], budget: int
) -> tuple[list[Message], int]:
    """Drop the oldest turns (a user message and what follows it up to the next one) until
    ``n_tokens(messages) <= budget``; the system prompt and the last message stay.

    Returns:
        ``(messages, how many were dropped)``.

    Raises:
        ContextFullError: the system prompt and the last message alone are over the budget.
    """
    kept = list(messages)
    dropped = 0
    while (n := n_tokens(kept)) > budget:
        first = 1 if kept and kept[0]["role"] == "system" else 0
        if len(kept) - first <= 1:
            raise ContextFullError(
                f"the message takes {n} tokens with the system prompt, over the {budget} the "
                "context leaves beside the reply: shorten it, lower --max-tokens or raise --n-ctx"
            )
        end = first + 1
        while end < len(kept) - 1 and kept[end]["role"] != "user":
            end += 1
        dropped += end - first
        del kept[first:end]
    return kept, dropped


def load_messages(path: Path) -> list[Message]:
    """The messages of a conversation saved by ``/save``.

    Raises:
        OSError: the file cannot be read.
        ValueError: the file is not a saved conversation (what is wrong is named), or it is
            not a file or too large (see :func:`read_file`).
    """
    try:
        data = json.loads(read_file(path))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not a saved lcgen chat (not JSON: {exc})") from None
    except ValueError as exc:  # not UTF-8, a device, too large
        raise ValueError(f"{path} is not a saved lcgen chat: {_reason(exc)}") from None
    messages = data.get("messages") if isinstance(data, dict) else None
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    ):
        raise ValueError(f"{path} is not a saved lcgen chat (no list of role/content messages)")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def cmd_models(args: argparse.Namespace) -> int:
    from lcgen.registry import cache_dir, is_assembly_pending, list_models

    rows = list_models()
    width = max(len(entry.name) for entry, _ in rows)
    missing = []
    for entry, path in rows:
        if path is not None:
            where = str(path)
        elif is_assembly_pending(entry):  # its wheels are installed: nothing to get
            where = f"installed; assembled into {cache_dir() / entry.filename} on first use"
        else:
            where = "not local (how to get it: below)"
            missing.append(entry)
        print(f"{entry.name:<{width}}  {entry.description}\n{'':<{width}}  -> {where}")
    if missing:
        print("\nTo get a model that is not local:")
        for entry in missing:
            print(f"  {entry.name}: {entry.sources[0].install_hint()}")
    print(f"\nllama.cpp backend: {_build_backend()}")
    return 0


def _build_backend() -> str:
    """What llama.cpp's build runs models on, and where layers go by default."""
    from lcgen._native.model import gpu_devices

    devices = gpu_devices()
    if not devices:
        return "CPU (no GPU backend built in; see README, GPU and Metal)"
    names = ", ".join(f"{backend} ({description})" for backend, description in devices)
    return f"{names}; models offload every layer unless --gpu-layers says otherwise"


def cmd_info(args: argparse.Namespace) -> int:
    model = _load(args)
    arch = model.metadata("general.architecture") or "?"
    trained = model.metadata(f"{arch}.context_length") or "?"
    size_mb = model.path.stat().st_size / 1e6
    rows = [
        ("file", f"{model.path} ({size_mb:.1f} MB)"),
        ("name", model.metadata("general.name") or "?"),
        ("model", model.description),
        ("parameters", f"{model.n_params:,}"),
        ("layers", model.metadata(f"{arch}.block_count") or "?"),
        ("vocabulary", f"{model.n_vocab:,} tokens"),
        ("context", f"{model.n_ctx:,} tokens (trained on {trained})"),
        ("chat template", "yes" if model.has_chat_template else "no"),
        ("backend", model.backend),
        (
            "threads",
            f"{model.n_threads}{', fewer while cores are busy' if model.adaptive_threads else ''}",
        ),
    ]
    for key, value in rows:
        print(f"{key:<14} {value}")
    model.close()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    model = _load(args)
    print(f"model: {model}\n")
    prompt = "Once upon a time"
    print(f"generate({prompt!r}, max_tokens=48), greedy:")
    start = time.perf_counter()
    text = model.generate(prompt, max_tokens=48)
    elapsed = time.perf_counter() - start
    print(f"  {text.strip()!r}\n  ({len(model.tokenize(text))} tokens in {elapsed:.2f}s)\n")
    print("stream('Write a haiku about the sea:', temperature=0.8, seed=7):")
    _print_stream(
        model.stream(
            "Write a haiku about the sea:", max_tokens=40, temperature=0.8, seed=7, stop=["\n\n\n"]
        )
    )
    print("\n\nchat([user: 'Name three colors.']):")
    print(
        "  "
        + model.chat([{"role": "user", "content": "Name three colors."}], max_tokens=40)
        .strip()
        .replace("\n", "\n  ")
    )
    print("\nA live sequence keeps its KV cache between calls:")
    with model.sequence("The capital of France is") as seq:
        first = seq.generate(max_tokens=5, stop=["\n"])
        seq.append(" Also,")
        second = seq.generate(max_tokens=12, stop=["\n"])
        print(f"  {seq.text!r}\n  ({first!r}, then {second!r}; {seq.n_tokens} tokens)")
    prompts = ["The sky is", "Water boils at", "The first president of the USA was"]
    print(f"\nThree prompts decoded together in one batch per step: {prompts}")
    for p, out in zip(prompts, model.generate(prompts, max_tokens=12, stop=["\n"]), strict=True):
        print(f"  {p!r} -> {out!r}")
    _demo_backtracking(model)
    model.close()
    return 0


def _demo_backtracking(model: lcgen.Model) -> None:
    """Banned phrases and the continuous API, on the same model."""
    rome = [{"role": "user", "content": "Tell me about the history of Rome."}]
    plain = model.chat(rome, max_tokens=24)
    clean = model.chat(rome, max_tokens=24, banned=["tapestry", "cradle"])
    print("\nBanned phrases rewind and retry; the prompt is decoded once:")
    print(f"  plain:  {plain.strip()!r}\n  banned: {clean.strip()!r}")
    stats = clean.stats
    print(f"  ({stats.rewinds} rewinds, {stats.redecoded} tokens decoded again)")
    print("\nContinuous: 3 samples of one prompt decoded together, then a choice on each:")
    text = lcgen.continuous(
        lcgen.generate.text(model, max_tokens=10, temperature=0.8, stop=["\n", ".", "?", "!"])
    )
    pick = lcgen.continuous(lcgen.generate.choice(model, [" Yes", " No"]))
    with (
        text("My favourite animal is", num_samples=3, seed=1) as story,
        pick(story + ". Is it a mammal? Answer:") as answers,
    ):
        for answer, weight in zip(answers, answers.weights.ravel(), strict=True):
            print(f"  {answer!r} (log-probability {weight:.1f})")


def _add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt text; - reads it from stdin")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--system", default=None, help="a system message (with --chat)")
    p.add_argument(
        "--suffix",
        default=None,
        help="fill in the middle: generate the text between the prompt and this suffix (a "
        "model with fill-in-the-middle tokens)",
    )
    p.add_argument(
        "--quiet", action="store_true", help="no speed summary on stderr after the output"
    )
    p.add_argument(
        "--grammar",
        help="GBNF text (containing ::=), a bundled grammar name (json, iso_date, ...) or a "
        ".gbnf file",
    )
    p.add_argument("--json-schema", help="a JSON Schema file: the output is JSON valid for it")
    p.add_argument("--choice", help="comma-separated options: the output is one of them")
    p.add_argument("--regex", help="a regular expression the whole output matches")


def build_parser() -> argparse.ArgumentParser:
    parser = server.Parser(
        prog="lcgen", description="Controllable, reversible generation with GGUF models."
    )
    parser.add_argument("--version", action="version", version=f"lcgen {lcgen.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands: list[tuple[str, str, Callable[..., int]]] = [
        ("generate", "stream a completion of PROMPT to stdout", cmd_generate),
        ("chat", "chat on stdin/stdout with the model's own chat template", cmd_chat),
        ("models", "list the model registry and what is available locally", cmd_models),
        ("info", "load MODEL and show its size, parameters and backend", cmd_info),
        ("demo", "run the demo on the bundled model", cmd_demo),
    ]
    for name, help_text, func in commands:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(func=func)
        if name in {"generate", "chat", "info"}:
            _add_model_args(p)
        if name in {"generate", "chat"}:
            _add_sampling_args(p, 256 if name == "generate" else None)
        if name == "generate":
            _add_generate_args(p)
        if name == "chat":
            p.add_argument("--system", default=None, help="a system message")
        if name == "demo":
            server.add_threads_argument(p)
            p.set_defaults(
                model=lcgen.DEFAULT_MODEL,
                n_ctx=4096,
                gpu_layers=None,
                cache_type_k="f16",
                cache_type_v="f16",
                verbose=False,
            )
    server.add_parser(sub)  # `lcgen serve` (its web parts load only when it runs)
    for command in sub.choices.values():
        command.set_defaults(parser=command)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``lcgen`` command; returns the exit status: 0, 1 for an error, 2 for a usage
    error, 130 after Ctrl-C, 141 when stdout was closed early."""
    _stderr_or_devnull()
    try:
        with server.one_line_warnings("lcgen"):
            args, unknown = build_parser().parse_known_args(sys.argv[1:] if argv is None else argv)
            if unknown:  # said by the command's parser: its --help lists what it takes
                args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
            _check_streams(args)
            return int(args.func(args))
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as Unix tools do
        _discard_stdout()
        return EXIT_BROKEN_PIPE
    except UsageError as exc:
        print(f"lcgen: error: {exc}", file=sys.stderr)
        return 2
    except (LcgenError, ValueError, TypeError, OSError) as exc:
        print(f"lcgen: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _stderr_or_devnull() -> None:
    """Python's sys.stderr is None when the command started with stderr closed (``2>&-``), and
    ``print(file=None)`` writes on stdout: the messages go to /dev/null (the status still says)."""
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 -- open until the process ends


def _check_streams(args: argparse.Namespace) -> None:
    """Before anything loads: the standard streams the command uses are open (Python's
    sys.stdin or sys.stdout is None when one was closed as it started: ``<&-``, ``>&-``).

    Raises:
        UsageError: one is not (what the command needs it for named).
    """
    if args.command == "serve":  # it writes only on stderr
        return
    if sys.stdout is None:
        raise UsageError(
            f"stdout is closed: lcgen {args.command} writes its output there "
            "(>/dev/null discards it)"
        )
    if sys.stdin is None and args.command == "chat":
        raise UsageError("stdin is closed: lcgen chat reads the messages from it")
    if sys.stdin is None and getattr(args, "prompt", None) == "-":
        raise UsageError("stdin is closed: the prompt - is read from it (or give it as text)")


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so that flushing what is left of it at exit does not fail
    again (and print "Exception ignored ... BrokenPipeError")."""
    with contextlib.suppress(OSError, ValueError):  # no file descriptor (a test's capture)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
