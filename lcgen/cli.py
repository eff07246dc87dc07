"""The ``lcgen`` command: generate, chat, models, demo."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import lcgen
from lcgen.decoding import Chunk
from lcgen.errors import LcgenError


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model", help="registry name (see `lcgen models`), .gguf path or hf:org/repo/file"
    )
    p.add_argument("--n-ctx", type=int, default=4096, help="context size in tokens (default 4096)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: cores, <= 8)")
    p.add_argument(
        "--gpu-layers",
        type=int,
        default=None,
        help="layers to offload to GPU/Metal (default: all when available)",
    )
    p.add_argument("--verbose", action="store_true", help="show llama.cpp's log")


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument(
        "--max-tokens",
        type=int,
        default=max_tokens,
        help=f"most tokens to generate (default {max_tokens})",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repeat-penalty", type=float, default=None)
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
        help="stop string (repeatable); text stops before it",
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
    p.add_argument("--ban-ignore-case", action="store_true", help="match --ban in any case")
    p.add_argument(
        "--max-retries",
        type=int,
        default=None,
        help="most rewinds and resamples for banned phrases (default 64)",
    )


def _load(args: argparse.Namespace) -> lcgen.Model:
    return lcgen.load(
        args.model,
        n_ctx=args.n_ctx,
        n_threads=args.threads,
        n_gpu_layers=args.gpu_layers,
        verbose=args.verbose,
    )


def _options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "repeat_penalty": args.repeat_penalty,
        "seed": args.seed,
        "stop": args.stop,
        "token_healing": args.token_healing,
        **_bans(args),
    }


def _bans(args: argparse.Namespace) -> dict[str, Any]:
    """--ban / --ban-regex / --ban-ignore-case / --max-retries as generation options."""
    patterns = []
    for regex in args.ban_regex or ():
        try:
            patterns.append(re.compile(regex))
        except re.error as exc:
            raise ValueError(f"--ban-regex {regex!r} is not a regular expression: {exc}") from None
    if not args.ban and not patterns:
        return {}
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


def _constraint(args: argparse.Namespace) -> dict[str, Any]:
    """The one --grammar / --json-schema / --choice / --regex given, as generation options."""
    given = [
        name
        for name in ("grammar", "json_schema", "choice", "regex")
        if getattr(args, name) is not None
    ]
    for name in given:
        if not getattr(args, name):
            raise ValueError(f"--{name.replace('_', '-')} is empty: give a value or leave it out")
    if len(given) > 1:
        raise ValueError(
            f"give at most one of --grammar, --json-schema, --choice, --regex; got {given}"
        )
    if args.grammar:
        return {"grammar": lcgen.Grammar.from_file(args.grammar)}
    if args.json_schema:
        with open(args.json_schema, encoding="utf-8") as f:
            return {"schema": json.load(f)}
    if args.choice:
        return {"choice": args.choice.split(",")}
    if args.regex:
        return {"regex": args.regex}
    return {}


def cmd_generate(args: argparse.Namespace) -> int:
    model = _load(args)
    last = _print_stream(model.stream(args.prompt, **_options(args), **_constraint(args)))
    sys.stdout.write("\n")
    if args.verbose and last is not None:
        print(f"[finish_reason={last.finish_reason} {last.stats}]", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    model = _load(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line or line.strip() in {"/exit", "/quit"}:
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        # The model's KV store holds the history: only the new turn's tokens are decoded.
        reply = "".join(c.text for c in _tee(model.chat_stream(messages, **_options(args))))
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": reply})


def _tee(chunks: Iterable[Chunk]) -> Iterable[Chunk]:
    for chunk in chunks:
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        yield chunk


def cmd_models(args: argparse.Namespace) -> int:
    from lcgen.registry import list_models

    rows = list_models()
    width = max(len(entry.name) for entry, _ in rows)
    for entry, path in rows:
        where = str(path) if path else "not local (`lcgen models` shows how to get it below)"
        print(f"{entry.name:<{width}}  {entry.description}\n{'':<{width}}  -> {where}")
    missing = [entry for entry, path in rows if path is None]
    if missing:
        print("\nTo get a model that is not local:")
        for entry in missing:
            print(f"  {entry.name}: {entry.sources[0].install_hint()}")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lcgen", description="Controllable, reversible generation with GGUF models."
    )
    parser.add_argument("--version", action="version", version=f"lcgen {lcgen.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands: list[tuple[str, str, Callable[..., int]]] = [
        ("generate", "stream a completion of PROMPT to stdout", cmd_generate),
        ("chat", "chat on stdin/stdout with the model's own chat template", cmd_chat),
        ("models", "list the model registry and what is available locally", cmd_models),
        ("demo", "run the demo on the bundled model", cmd_demo),
    ]
    for name, help_text, func in commands:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(func=func)
        if name in {"generate", "chat"}:
            _add_model_args(p)
            _add_sampling_args(p, 256 if name == "generate" else 512)
        if name == "generate":
            p.add_argument("prompt", help="the prompt text")
            p.add_argument(
                "--grammar", help="a bundled grammar name (json, iso_date, ...) or a .gbnf file"
            )
            p.add_argument(
                "--json-schema", help="a JSON Schema file: the output is JSON valid for it"
            )
            p.add_argument("--choice", help="comma-separated options: the output is one of them")
            p.add_argument("--regex", help="a regular expression the whole output matches")
        if name == "chat":
            p.add_argument("--system", default=None, help="a system message")
        if name == "demo":
            p.set_defaults(
                model=lcgen.DEFAULT_MODEL, n_ctx=4096, threads=None, gpu_layers=None, verbose=False
            )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``lcgen`` command; returns the exit status."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return int(args.func(args))
    except (LcgenError, ValueError, TypeError, OSError) as exc:
        print(f"lcgen: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
