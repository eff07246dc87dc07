"""Checkpoint, rewind, fork, save/load on the real bundled model: invariants, not snapshots."""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import lcgen
from lcgen.runtime import statefile as ckpt
from lcgen.runtime.run import PlainRun

PROMPT = "Once upon a time"


def run(seq: lcgen.Sequence, n: int, **options: Any) -> tuple[list[int], list[np.ndarray]]:
    """Generate n tokens on seq, returning them and the logits each was sampled from (seen by
    a hook that accepts every candidate)."""
    rows: list[np.ndarray] = []

    def record(step: lcgen.Step) -> None:
        rows.append(step.logits)

    text = seq.generate(max_tokens=n, hooks=[record], **options)
    return list(text.tokens), rows


@pytest.mark.parametrize("k", [1, 5, 19, 20])
def test_greedy_rewind_gives_same_tokens_and_bit_identical_logits(
    model: lcgen.Model, k: int
) -> None:
    with model.sequence(PROMPT) as seq:
        run(seq, 2)  # the rewind target below lies among generated tokens
        first, first_rows = run(seq, 20)
        seq.rewind(k)
        again, again_rows = run(seq, k)
        assert again == first[-k:]
        for a, b in zip(first_rows[-k:], again_rows, strict=True):
            assert np.array_equal(a, b)


@pytest.mark.parametrize("n_words", [3, 80])  # one token decoded alone; a batch of 64+ rows
def test_a_rewind_to_the_end_of_the_prompt_gives_bit_identical_logits(
    model: lcgen.Model, n_words: int
) -> None:
    """The README's pattern (a checkpoint right after opening): the rewind dropped the last
    prompt token's cell, and that token decoded alone gave logits the prompt's batch had not
    (up to 1.5 apart; greedy tokens flipped at margins of 0.07-0.14). The logits kept after
    the prompt are sampled from again instead: nothing is decoded."""
    prompt = " ".join(f"word{i}" for i in range(n_words))
    with model.sequence(prompt, seed=3) as seq:
        cp = seq.checkpoint()
        first, first_rows = run(seq, 12)
        seq.rewind(cp)
        before = model.context.n_decoded
        again, again_rows = run(seq, 1)
        assert model.context.n_decoded == before  # the kept logits: nothing decoded
        again_more, more_rows = run(seq, 11)
        assert again + again_more == first
        for a, b in zip(first_rows, again_rows + more_rows, strict=True):
            assert np.array_equal(a, b)
        seq.rewind(cp)  # seeded sampling too
        sampled = seq.generate(max_tokens=12, temperature=0.9)
        seq.rewind(cp)
        assert seq.generate(max_tokens=12, temperature=0.9) == sampled


def test_rewind_to_checkpoint_restores_seeded_sampling(model: lcgen.Model) -> None:
    with model.sequence(PROMPT, seed=11) as seq:
        seq.generate(max_tokens=5, temperature=0.9)
        cp = seq.checkpoint()
        a = seq.generate(max_tokens=25, temperature=0.9)
        seq.rewind(cp)
        b = seq.generate(max_tokens=25, temperature=0.9)
        assert a == b
        # Without restoring, the RNG would have moved on.
        c = seq.generate(max_tokens=25, temperature=0.9)
        assert c != b


def test_rewind_by_count_restores_the_rng_from_its_log(model: lcgen.Model) -> None:
    with model.sequence(PROMPT, seed=5) as seq:
        tokens, _ = run(seq, 30, temperature=1.0)
        for k in (1, 7, 30):
            seq.rewind(k)
            again, _ = run(seq, k, temperature=1.0)
            assert again == tokens[-k:]


def test_rewind_across_a_reseed(model: lcgen.Model) -> None:
    with model.sequence(PROMPT, seed=1) as seq:
        cp = seq.checkpoint()
        a = seq.generate(max_tokens=8, temperature=1.0)
        seq.generate(max_tokens=8, temperature=1.0, seed=99)  # reseeds the sequence's RNG
        seq.rewind(cp)
        assert seq.generate(max_tokens=8, temperature=1.0) == a


def test_a_checkpoint_after_a_reseed_holds_the_new_seed(model: lcgen.Model) -> None:
    with model.sequence(PROMPT, seed=1) as seq:
        seq.reseed(7)
        cp = seq.checkpoint()  # held the state from before the reseed
        a = seq.generate(max_tokens=8, temperature=1.0)
        seq.rewind(cp)
        assert seq.generate(max_tokens=8, temperature=1.0) == a
        seq.rewind(8)  # the position's state is the one its first draw used
        assert seq.generate(max_tokens=8, temperature=1.0) == a
        with seq.fork(seed=9) as child:
            start = child.checkpoint()
            b = child.generate(max_tokens=8, temperature=1.0)
            child.rewind(start)
            assert child.generate(max_tokens=8, temperature=1.0) == b


def test_fork_equals_a_fresh_run_with_the_same_history(
    model: lcgen.Model, cold_model: lcgen.Model
) -> None:
    with model.sequence(PROMPT) as parent:
        parent.generate(max_tokens=10)
        child = parent.fork()
        grandchild = child.fork()
        parent_more = parent.generate(max_tokens=12)
        child.append(" Suddenly,")
        child_more = child.generate(max_tokens=12)
        grand_more = grandchild.generate(max_tokens=12)
        with cold_model.sequence(PROMPT) as ref:
            ref.generate(max_tokens=10)
            ref_more = ref.generate(max_tokens=12)
            ref.rewind(12)
            ref.append(" Suddenly,")
            ref_child = ref.generate(max_tokens=12)
        assert parent_more == ref_more == grand_more
        assert child_more == ref_child
        child.close()
        grandchild.close()


def test_fork_keeps_the_rng_or_reseeds(model: lcgen.Model) -> None:
    with model.sequence(PROMPT, seed=3) as seq:
        seq.generate(max_tokens=3, temperature=1.0)
        same, other = seq.fork(), seq.fork(seed=1234)
        a = seq.generate(max_tokens=12, temperature=1.0)
        assert same.generate(max_tokens=12, temperature=1.0) == a
        assert other.generate(max_tokens=12, temperature=1.0) != a
        same.close()
        other.close()


def test_fork_beyond_free_slots_and_close_frees(model_path: Path) -> None:
    with lcgen.Model(model_path, n_seq_max=3, n_ctx=512) as small:
        seq = small.sequence(PROMPT)
        seq.generate(max_tokens=2)
        a = seq.fork()
        b = a.fork()
        with pytest.raises(lcgen.SlotsExhaustedError, match="all 3 sequence slots"):
            b.fork()
        b.close()
        c = a.fork()
        assert c.generate(max_tokens=4) == a.generate(max_tokens=4)
        for s in (seq, a, c):
            s.close()
        assert small.cache.stats.live == 0


def test_checkpoint_of_parent_is_valid_on_fork_within_shared_history(model: lcgen.Model) -> None:
    with model.sequence(PROMPT) as seq:
        cp = seq.checkpoint()
        seq.generate(max_tokens=4)
        child = seq.fork()
        child.generate(max_tokens=4)
        child.rewind(cp)
        assert child.tokens == seq.tokens[: cp.n_tokens]
        child.close()


def test_rewind_errors(model: lcgen.Model) -> None:
    with model.sequence(PROMPT) as seq, model.sequence("other") as other:
        seq.generate(max_tokens=6)
        n = seq.n_tokens
        with pytest.raises(lcgen.RewindError, match=f"cannot rewind {n + 1} tokens: .* has {n}"):
            seq.rewind(n + 1)
        with pytest.raises(lcgen.RewindError, match="cannot rewind -1 tokens"):
            seq.rewind(-1)
        with pytest.raises(lcgen.RewindError, match="belongs to another sequence"):
            seq.rewind(other.checkpoint())
        late = seq.checkpoint()
        seq.rewind(4)
        with pytest.raises(
            lcgen.RewindError, match=f"position {n} lies beyond .* position {n - 4}"
        ):
            seq.rewind(late)
        mid = seq.checkpoint()
        seq.rewind(2)
        seq.generate(max_tokens=3)
        with pytest.raises(lcgen.RewindError, match=f"up to position {n - 4} has changed"):
            seq.rewind(mid)
    with pytest.raises(lcgen.ClosedError, match="closed"):  # as everything after close
        seq.rewind(1)


def test_rewind_into_the_prompt_and_to_empty(model: lcgen.Model) -> None:
    with model.sequence(PROMPT) as seq:
        expected = model.generate(PROMPT, max_tokens=8)
        seq.generate(max_tokens=8)
        seq.rewind(10)
        assert seq.tokens == model.tokenize(PROMPT)[:2]
        seq.append_tokens(model.tokenize(PROMPT)[2:])
        assert seq.generate(max_tokens=8) == expected
        seq.rewind(seq.n_tokens)
        assert seq.n_tokens == 0
        with pytest.raises(ValueError, match="empty"):
            seq.generate(max_tokens=1)


def test_save_load_round_trip(model: lcgen.Model, model_path: Path, tmp_path: Path) -> None:
    # Logits depend on where a sequence's cells sit in the shared KV pool (attention sums over
    # cells in pool order), so the loaded copy goes into its own context for an exact comparison.
    with model.sequence(PROMPT, seed=2) as seq, lcgen.Model(model_path, n_ctx=512) as other:
        seq.generate(max_tokens=12, temperature=0.8)
        path = tmp_path / "story.lcs"
        seq.save(path)
        with lcgen.Sequence.load(other, path) as loaded:
            assert loaded.tokens == seq.tokens
            assert loaded.text == seq.text
            assert loaded.generate(max_tokens=12, temperature=0.8) == seq.generate(
                max_tokens=12, temperature=0.8
            )
            loaded.rewind(20)
            seq.rewind(20)
            assert loaded.generate(max_tokens=8, temperature=0.8) == seq.generate(
                max_tokens=8, temperature=0.8
            )


def test_save_load_in_a_new_process_continues_identically(
    model: lcgen.Model, model_path: Path, tmp_path: Path
) -> None:
    path = tmp_path / "story.lcs"
    with model.sequence(PROMPT, seed=4) as seq:
        seq.generate(max_tokens=10, temperature=0.7)
        seq.save(path)
        n = seq.n_tokens
        seq.generate(max_tokens=16, temperature=0.7)
        expected = seq.tokens[n:]
    script = textwrap.dedent(f"""
        import json, lcgen
        model = lcgen.Model({str(model_path)!r})
        seq = lcgen.Sequence.load(model, {str(path)!r})
        n = seq.n_tokens
        seq.generate(max_tokens=16, temperature=0.7)
        print(json.dumps(seq.tokens[n:]))
    """)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300
    )
    assert json.loads(out.stdout) == expected


def test_a_checkpoint_from_another_process_is_refused(model_path: Path, tmp_path: Path) -> None:
    """Stamps came from a counter every process started at 1: a checkpoint pickled in one
    process matched a sequence of the same shape in another, and the rewind installed the
    other process's RNG state."""
    script = textwrap.dedent(f"""
        import pickle, sys, lcgen
        model = lcgen.Model({str(model_path)!r}, n_ctx=256)
        seq = model.sequence(sys.argv[1], seed=1)
        seq.generate(max_tokens=5, temperature=0.8)
        path = {str(tmp_path / "cp.pickle")!r}
        if sys.argv[2] == "save":
            with open(path, "wb") as f:
                pickle.dump(seq.checkpoint(), f)
        else:
            with open(path, "rb") as f:
                cp = pickle.load(f)
            try:
                seq.rewind(cp)
                print("taken")
            except lcgen.RewindError as exc:
                print("refused:", exc)
    """)

    def run(prompt: str, mode: str) -> str:
        done = subprocess.run(
            [sys.executable, "-c", script, prompt, mode],
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        )
        return done.stdout

    run("The capital of France is", "save")
    assert "refused: the checkpoint" in run("My favourite food is tasty", "load")


def _saved(model: lcgen.Model) -> bytearray:
    with model.sequence(PROMPT) as seq:
        seq.generate(max_tokens=4)
        return seq.to_bytes()


def test_load_rejects_bad_files(model: lcgen.Model, tmp_path: Path) -> None:
    data = _saved(model)
    cases = {
        "truncated": data[: len(data) // 2],
        "corrupted": data[:100] + bytes([data[100] ^ 1]) + data[101:],
        "empty": b"",
        "not ours": b"GGUF" + bytes(200),
    }
    for name, bad in cases.items():
        with pytest.raises(lcgen.StateFileError, match=r"truncated|corrupted|not an lcgen"):
            lcgen.Sequence.from_bytes(model, bad)
        (tmp_path / name).write_bytes(bad)
        with pytest.raises(lcgen.StateFileError):
            lcgen.Sequence.load(model, tmp_path / name)
    with pytest.raises(lcgen.StateFileError, match="cannot read"):
        lcgen.Sequence.load(model, tmp_path / "missing.lcs")
    # /dev/zero was read until memory ran out, a pipe with no writer blocked forever
    os.mkfifo(tmp_path / "pipe")
    for other in ("/dev/zero", tmp_path / "pipe", tmp_path):
        with pytest.raises(lcgen.StateFileError, match="not a regular file"):
            lcgen.Sequence.load(model, other)
        with pytest.raises(lcgen.StateFileError, match="not a regular file"):
            model.cache.load(other)
    assert model.cache.stats.live == 0


def test_a_save_under_the_longest_file_name_works(model: lcgen.Model, tmp_path: Path) -> None:
    """The temporary name (the target's, a pid, a thread id, a random part) went over the 255
    characters a name may have: a raw OSError escaped, from the cleanup."""
    path = tmp_path / ("s" * 251 + ".lcs")
    with model.sequence(PROMPT) as seq:
        seq.generate(max_tokens=2)
        seq.save(path)
        with lcgen.Sequence.load(model, path) as back:
            assert back.text == seq.text
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def _encode(header: dict[str, object], kv: memoryview) -> bytearray:
    def write_kv(out: bytearray, at: int, size: int) -> int:
        out[at : at + size] = kv
        return size

    return ckpt.encode(header, len(kv), write_kv)


def test_load_rejects_other_versions_and_models(model: lcgen.Model) -> None:
    header, kv = ckpt.decode(_saved(model))
    assert lcgen.Sequence.from_bytes(model, _encode(header, kv)).close() is None
    newer = _encode(header, kv)
    struct.pack_into("<I", newer, 7, ckpt.FORMAT_VERSION + 1)
    body = bytes(newer[:-32])
    newer_file = body + ckpt.hashlib.sha256(body).digest()
    with pytest.raises(lcgen.StateFileError, match=f"version {ckpt.FORMAT_VERSION + 1}"):
        lcgen.Sequence.from_bytes(model, newer_file)
    other = _encode({**header, "model": "0" * 64}, kv)
    with pytest.raises(lcgen.StateFileError, match="another model"):
        lcgen.Sequence.from_bytes(model, other)
    assert model.cache.stats.live == 0


def test_saving_while_another_thread_generates_writes_only_files_that_load(
    model: lcgen.Model, tmp_path: Path
) -> None:
    """The header's decoded count was read before the cells were copied, while the other
    thread went on decoding: saves raised "could not copy the state", or wrote a file that
    did not load back ("says 61 tokens have KV cells, its state holds 62"), replacing a good
    one."""
    path = tmp_path / "busy.lcs"
    no_end = {t: float("-inf") for t in range(model.n_vocab) if model.is_eog(t)}
    with model.sequence("A long story begins:", seed=5) as seq:
        worker = threading.Thread(
            target=lambda: seq.generate(max_tokens=60, temperature=0.8, logit_bias=no_end)
        )
        worker.start()
        saved = 0
        while worker.is_alive():
            try:
                seq.save(path)
            except lcgen.RewindError:  # caught between a decode and its count: refused
                continue
            saved += 1
            lcgen.Sequence.load(model, path).close()
        worker.join()
        assert saved > 0 and seq.n_tokens == len(model.tokenize("A long story begins:")) + 60


def test_save_is_atomic(
    model: lcgen.Model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "story.lcs"
    with model.sequence(PROMPT) as seq:
        seq.save(path)
        before = path.read_bytes()
        seq.generate(max_tokens=4)

        def crash(*args: object) -> None:
            raise OSError("disk full")

        monkeypatch.setattr(os, "replace", crash)
        with pytest.raises(lcgen.StateFileError, match=f"cannot write .*{path.name}.*: disk full"):
            seq.save(path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["story.lcs"]


def test_save_replaces_only_regular_files_and_follows_links(
    model: lcgen.Model, tmp_path: Path
) -> None:
    # The atomic rename replaced whatever the path named: as root, /dev/full became a file.
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    real = tmp_path / "real.lcs"
    link = tmp_path / "link.lcs"
    link.symlink_to(real.name)
    with model.sequence(PROMPT) as seq:
        with pytest.raises(lcgen.StateFileError, match=r"pipe.*it is not a regular file"):
            seq.save(pipe)
        seq.save(link)  # the file the link names is written; the link stays a link
        assert link.is_symlink() and real.read_bytes() == seq.to_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.lcs", "pipe", "real.lcs"]


def test_generator_restore_needs_a_checkpoint_taken_with_it(model: lcgen.Model) -> None:
    with model.sequence(PROMPT) as seq:
        gen = seq.run(max_tokens=4).generator
        plain = seq.checkpoint()
        with pytest.raises(ValueError, match=r"seq\.checkpoint\(generator\)"):
            seq.rewind(plain, gen)
        with pytest.raises(ValueError, match=r"seq\.checkpoint\(generator\)"):
            seq.rewind(1, gen)
        with_gen = seq.checkpoint(gen)
        assert with_gen.generation is not None and with_gen.generation.n_tokens == 0


def test_a_checkpoint_taken_at_a_stop_restores_the_stop_string(model: lcgen.Model) -> None:
    stop = str(model.generate(PROMPT, max_tokens=24, temperature=0)).split()[2]
    with model.sequence(PROMPT) as seq:
        run = seq.run(max_tokens=24, temperature=0, stop=[stop])
        assert isinstance(run, PlainRun)
        while not run.is_done:
            run.step()
        gen = run.generator
        assert (gen.finish_reason, gen.stop_hit) == ("stop", stop)
        run.rewind(run.checkpoint())
        assert (gen.finish_reason, gen.stop_hit) == ("stop", stop)


def test_a_saved_file_replaced_keeps_its_permissions(model: lcgen.Model, tmp_path: Path) -> None:
    # (the new file took the umask's: a private chat log became readable to all)
    private, cache = tmp_path / "private.lcs", tmp_path / "private.lcc"
    for path in (private, cache):
        path.write_bytes(b"old")
        path.chmod(0o600)
    with model.sequence(PROMPT) as seq:
        seq.save(private)
        model.cache.save(cache)
    assert [oct(p.stat().st_mode & 0o777) for p in (private, cache)] == ["0o600", "0o600"]
    assert private.read_bytes() != b"old"


def test_what_owns_kv_slots_refuses_copies_and_pickles_saying_what_to_do(
    model: lcgen.Model,
) -> None:
    # copy.copy(seq) made a second object on the same slot: generating on it broke the first
    import copy
    import pickle

    with model.sequence(PROMPT) as seq:
        state = lcgen.continuous(lcgen.generate.text(model, max_tokens=2))("Hi")
        try:
            for obj, advice in ((seq, "fork it"), (model, "share it"), (state, "texts")):
                for act in (copy.copy, copy.deepcopy, pickle.dumps):
                    with pytest.raises(TypeError, match=f"cannot be .*{advice}"):
                        act(obj)
        finally:
            state.close()
        assert seq.generate(max_tokens=3) == model.generate(PROMPT, max_tokens=3)


def test_a_closed_model_s_cache_load_raises_closed_error(model_path: Path, tmp_path: Path) -> None:
    # it answered with a count from the ledger that outlived the context
    path = tmp_path / "c.lcc"
    small = lcgen.Model(model_path, n_ctx=256, n_seq_max=2)
    small.generate(PROMPT, max_tokens=2)
    assert small.cache.save(path) == 1
    small.close()
    with pytest.raises(lcgen.ClosedError):
        small.cache.load(path)
    with pytest.raises(lcgen.ClosedError):  # it wrote a file of the entries it still listed
        small.cache.save(tmp_path / "d.lcc")
    assert not (tmp_path / "d.lcc").exists()


def test_save_paths_no_file_can_have_raise_state_file_error(
    model: lcgen.Model, tmp_path: Path
) -> None:
    loop = tmp_path / "loop.lcs"
    loop.symlink_to(loop.name)  # RuntimeError: a loop of links
    folder_like = str(tmp_path / "x.lcs") + "/"  # was saved as x.lcs, which then did not load
    paths = [loop, tmp_path / ("a" * 300 + ".lcs"), folder_like]  # OSError: a name too long
    with model.sequence(PROMPT) as seq:
        for path in paths:
            with pytest.raises(lcgen.StateFileError, match="cannot write"):
                seq.save(path)
            with pytest.raises(lcgen.StateFileError, match="cannot write"):
                model.cache.save(path)
    assert not (tmp_path / "x.lcs").exists()


def test_threads_saving_to_one_path_all_succeed_and_orphans_are_removed(
    model: lcgen.Model, tmp_path: Path
) -> None:
    import threading

    path = tmp_path / "shared.lcs"
    dead = tmp_path / f".shared.lcs.{2**22 + 12345}.1.abcd.tmp"  # a pid that is not running
    dead.write_bytes(b"left by a writer that was killed")
    # a number no pid can be (os.kill raised OverflowError: every save failed)
    (tmp_path / f".shared.lcs.{10**20}.1.abcd.tmp").write_bytes(b"not ours to keep")
    with model.sequence(PROMPT) as seq:
        seq.generate(max_tokens=3)
        errors: list[BaseException] = []

        def save() -> None:
            try:
                seq.save(path)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=save) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        expected = seq.to_bytes()
    assert path.read_bytes() == expected
    assert [p.name for p in tmp_path.iterdir()] == ["shared.lcs"]


def test_saving_a_sequence_whose_logits_are_kept_leaves_it_as_it_was(model: lcgen.Model) -> None:
    """Every token decoded, with the logits after them kept (a prefilled sequence, one opened
    on a cached prompt): a save cut the last token's cell and dropped the logits, so the next
    step decoded the token again, alone, and its logits moved (0.067 seen on the first token);
    the file keeps the logits too, and the loaded copy samples from them."""
    prompt = "A prefilled prompt, saved before it generates anything at all"
    model.cache.clear()
    with model.sequence(prompt) as plain:
        plain.prefill()
        expected = plain.generate(max_tokens=6, logprobs=0)
    model.cache.clear()
    with model.sequence(prompt) as seq:
        seq.prefill()
        data = seq.to_bytes()
        out = seq.generate(max_tokens=6, logprobs=0)
        assert out.tokens == expected.tokens and out.stats.decoded == expected.stats.decoded == 5
        assert [e.logprob for e in out.logprobs] == [e.logprob for e in expected.logprobs]
    stats = model.cache.stats
    with lcgen.Sequence.from_bytes(model, data) as loaded:
        # it looked for no cached prefix: neither a hit nor a miss (each load was a miss)
        assert (model.cache.stats.hits, model.cache.stats.misses) == (stats.hits, stats.misses)
        before = model.context.n_decoded
        again = loaded.generate(max_tokens=6, logprobs=0)
        assert model.context.n_decoded - before == 5  # the logits came with the file
        assert again.logprobs[0].logprob == expected.logprobs[0].logprob
    header, kv = ckpt.decode(data)
    assert header["logits"] is True
    short = _encode(header, kv[:1000])
    with pytest.raises(lcgen.StateFileError, match=r"logits are cut short \(1000 bytes\)"):
        lcgen.Sequence.from_bytes(model, short)
    nan = np.full(model.n_vocab, np.nan, dtype="<f4").tobytes()
    forged = _encode(header, memoryview(bytes(kv[: len(kv) - len(nan)]) + nan))
    with pytest.raises(lcgen.StateFileError, match="logits are not all finite"):
        lcgen.Sequence.from_bytes(model, forged)
    assert model.cache.stats.live == 0


def _forged(model: lcgen.Model, **changes: object) -> bytearray:
    """A saved sequence with header fields changed and the checksum recomputed."""
    header, kv = ckpt.decode(_saved(model))
    return _encode({**header, **changes}, kv)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"n_decoded": -3}, "have KV cells"),
        ({"n_decoded": 10**6}, "have KV cells"),
        ({"tokens": [1, 2, -7]}, "not token ids"),
        ({"tokens": "hello"}, "not token ids"),
        ({"tokens": [True, 2, 3]}, "not token ids"),  # (a TypeError escaped)
        ({"n_decoded": True}, "have KV cells"),
        ({"rng": "x"}, "malformed"),
        ({"rng_log": [[1]]}, "malformed"),
        # loaded, then a rewind failed far from the file: "TypeError: state must be a dict"
        ({"rng_log": [[3, "junk"]]}, "malformed"),
        ({"rng_log": [["3", {}]]}, "malformed"),
        ({"rng_log": {"3": 1}}, "malformed"),
        # (OverflowError escaped)
        ({"rng": {"bit_generator": "PCG64", "state": {"state": 2**200, "inc": 1}}}, "malformed"),
        ({"rng_log": [[3, {"bit_generator": "PCG64", "state": {"state": -1}}]]}, "malformed"),
        ({"logits": 1}, "'logits' field is malformed"),
        ({"logits": True}, "all have, with the logits after them"),  # (its last one pending)
    ],
)
def test_forged_headers_with_a_valid_checksum_are_refused(
    model: lcgen.Model, changes: dict[str, object], message: str
) -> None:
    with pytest.raises(lcgen.StateFileError, match=message):
        lcgen.Sequence.from_bytes(model, _forged(model, **changes))
    assert model.cache.stats.live == 0


@pytest.mark.parametrize(
    ("cell", "position"),
    [(0, -1000), (3, 5), (1, 0)],  # negative; a gap (and a repeat); a repeat
)
def test_forged_cell_positions_are_refused_before_llama_cpp_loads_them(
    model: lcgen.Model, cell: int, position: int
) -> None:
    """llama.cpp loads a saved state's cell positions as written: a cell at -1000 could never
    be removed again (removals start at 0) and sat in the attention of every later sequence in
    that slot, silently, until the model was reloaded."""
    header, kv = ckpt.decode(_saved(model))
    forged = bytearray(kv)
    struct.pack_into("<i", forged, 16 + 12 * cell, position)  # cell `cell`'s position
    with pytest.raises(lcgen.StateFileError, match="not at consecutive positions"):
        lcgen.Sequence.from_bytes(model, _encode(header, memoryview(forged)))
    assert model.cache.stats.live == 0
    with model.sequence(PROMPT) as seq:  # the slots hold nothing of it
        assert seq.generate(max_tokens=4) == model.generate(PROMPT, max_tokens=4)
        for slot in range(model.context.n_seq_max + 1):
            low, _ = model.context.pos_range(slot)
            assert low >= -1


def test_cells_that_give_nan_are_dropped_not_parked_for_other_calls(
    model: lcgen.Model,
) -> None:
    """A forged state whose keys are NaN (its checksum made to fit): its own generation raises
    DecodeError, and its cells were parked on close, so every later call sharing its prefix
    raised too until cache.clear()."""
    header, kv = ckpt.decode(_saved(model))
    model.cache.clear()
    forged = bytearray(kv)
    (count,) = struct.unpack_from("<I", forged, 12)
    at = 16 + 12 * count  # the data: v_trans, n_layer, then layer 0's key type and row size
    (row,) = struct.unpack_from("<Q", forged, at + 12)
    forged[at + 20 : at + 20 + count * row] = b"\xff\x7f" * (count * row // 2)
    bad = lcgen.Sequence.from_bytes(model, _encode(header, memoryview(forged)))
    with bad, pytest.raises(lcgen.DecodeError, match="NaN"):
        bad.generate(max_tokens=3)
    assert model.cache.stats.entries == 0
    expected = model.generate(PROMPT + " jumps", max_tokens=3, temperature=0)
    model.cache.clear()
    assert model.generate(PROMPT + " jumps", max_tokens=3, temperature=0) == expected


def test_states_whose_cells_lie_out_of_position_order_load(
    model: lcgen.Model, tmp_path: Path
) -> None:
    """llama.cpp writes a sequence's cells in the order they lie in the pool: after a clear, a
    sequence's later cells land in the cells freed before its first ones. Its own files were
    refused as forged (cells "not at consecutive positions")."""
    parked = model.sequence(list(range(1000, 1100)))
    parked.prefill()
    parked.close()  # its cells stay, parked, before the next sequence's
    with model.sequence(list(range(2000, 2100))) as seq:
        seq.prefill()
        model.cache.clear()  # frees the parked cells: the next ones go there
        seq.generate(max_tokens=5)
        data = seq.to_bytes()
        _, kv = ckpt.decode(data)
        (count,) = struct.unpack_from("<I", kv, 12)
        cells = np.frombuffer(kv[16 : 16 + 12 * count], dtype="<i4").reshape(count, 3)
        assert (np.diff(cells[:, 0]) < 0).any()  # the case: out of position order
        with lcgen.Sequence.from_bytes(model, data) as loaded:
            assert loaded.generate(max_tokens=8) == seq.generate(max_tokens=8)
        path = tmp_path / "cache.lcc"
        assert model.cache.save(path) >= 1
    model.cache.clear()
    assert model.cache.load(path) >= 1


def test_a_header_nested_deeper_than_json_reads_is_refused(model: lcgen.Model) -> None:
    _, kv = ckpt.decode(_saved(model))
    data = _encode({"a": 1}, kv)
    head = b"[" * 100_000 + b"]" * 100_000  # a RecursionError escaped
    (head_len,) = struct.unpack_from("<I", data, 11)
    assert data[15 : 15 + head_len] == b'{"a":1}'
    nested = data[:11] + struct.pack("<I", len(head)) + head + data[15 + head_len : -32]
    nested += ckpt.hashlib.sha256(bytes(nested)).digest()
    with pytest.raises(lcgen.StateFileError, match="header is not JSON text"):
        lcgen.Sequence.from_bytes(model, nested)


def test_forged_files_whose_header_is_not_an_object_are_refused(model: lcgen.Model) -> None:
    # an AttributeError ('list' object has no attribute 'get') and a JSONDecodeError before
    _, kv = ckpt.decode(_saved(model))
    listed = _encode([1, 2], kv)  # type: ignore[arg-type]
    with pytest.raises(lcgen.StateFileError, match="header is not a JSON object: \\[1, 2\\]"):
        lcgen.Sequence.from_bytes(model, listed)
    garbled = _encode({"a": 1}, kv)
    garbled[15:22] = b"\xff" * 7  # the header's 7 bytes, then the checksum made to fit
    garbled[-32:] = ckpt.hashlib.sha256(bytes(garbled[:-32])).digest()
    with pytest.raises(lcgen.StateFileError, match="header is not JSON text"):
        lcgen.Sequence.from_bytes(model, garbled)
    with pytest.raises(TypeError, match=r"a saved sequence is bytes .*, got str"):
        lcgen.Sequence.from_bytes(model, "abc")  # type: ignore[arg-type]
    assert model.cache.stats.live == 0


def test_rewind_targets_that_are_not_checkpoints_of_it(model: lcgen.Model) -> None:
    with model.sequence(PROMPT) as seq:
        run = seq.run(max_tokens=4)
        cp = run.checkpoint()
        run.step()
        with pytest.raises(lcgen.RewindError, match=">= 0"):
            seq.rewind(dataclasses.replace(cp, n_tokens=-1))
        for bad in (1.5, None, "2"):
            with pytest.raises(TypeError, match="Checkpoint or a number"):
                seq.rewind(bad)  # type: ignore[arg-type]
        other = seq.run(max_tokens=4).generator
        before = seq.tokens
        with pytest.raises(lcgen.RewindError, match="another generator"):
            seq.rewind(cp, other)
        assert seq.tokens == before  # refused before anything changed
        run.rewind(cp)
        assert run.step().tokens


def test_a_step_whose_pending_token_went_elsewhere_says_so(model: lcgen.Model) -> None:
    # Another thread decoding the sequence between a step's request and its decode left the
    # step nothing to decode: an AssertionError ("a sequence had no pending token").
    from lcgen.runtime.run import decode

    with model.sequence("Hello there") as seq:
        decode([seq])
        with pytest.raises(lcgen.RewindError, match="drive a sequence from one thread"):
            decode([seq])  # its pending token is decoded already, as by that other thread


def test_a_run_refuses_a_sequence_changed_behind_its_back(model: lcgen.Model) -> None:
    """A rewind, an append or another run on the sequence while a generation is live: the
    generation raises at its next step instead of sampling on from the wrong tokens (its
    regex broken, its stream no longer the sequence's text)."""
    regex = r" \(\d{3}\) \d{3}-\d{4}"
    with model.sequence("Call us at", seed=1) as seq:
        stream = seq.stream(max_tokens=20, regex=regex)
        [next(stream) for _ in range(3)]
        seq.rewind(2)
        with pytest.raises(lcgen.RewindError, match="changed outside this generation"):
            next(stream)
    with model.sequence("Call us at", seed=1) as seq:
        run = seq.run(max_tokens=20, regex=regex)
        run.step()
        seq.append(" hello")
        with pytest.raises(lcgen.RewindError, match="changed outside"):
            run.step()
    with model.sequence("Once upon a time", seed=1) as seq:
        first, second = seq.run(max_tokens=8), seq.run(max_tokens=8)
        first.step()
        with pytest.raises(lcgen.RewindError, match="changed outside"):
            second.step()  # the first run's token is not its own
        first.step()  # the first one goes on
        # the documented way to rewind a run through its sequence: both restored together
        cp = first.checkpoint()
        first.step()
        seq.rewind(cp, first.generator)
        first.step()
        assert seq.tokens[-len(first.generator.tokens) :] == first.generator.tokens


def test_a_checkpoint_of_another_run_is_refused_and_changes_nothing(model: lcgen.Model) -> None:
    with model.sequence("A pet as JSON:\n", seed=4) as seq:
        first = seq.run(max_tokens=10, temperature=0.8)
        checkpoints = []
        for _ in range(5):
            first.step()
            checkpoints.append(first.checkpoint())
        second = seq.run(max_tokens=5)
        second.step()
        tokens = seq.tokens
        with pytest.raises(lcgen.RewindError, match="another generator"):
            second.rewind(checkpoints[1])
        assert seq.tokens == tokens  # nothing changed: the second run goes on
        second.step()


@pytest.mark.parametrize(
    "options",
    [{}, {"hooks": [lambda step: None]}, {"validators": [lambda text: None]}, {"banned": ["x!"]}],
    ids=["plain", "hooks", "validators", "banned"],
)
def test_every_run_rewinds_to_a_checkpoint_of_its_end(
    model: lcgen.Model, options: dict[str, Any]
) -> None:
    """A checkpoint of the current end (no mark of a backtracking run is at it yet) is a
    no-op rewind, mid-generation and after the run finished."""
    with model.sequence(PROMPT) as ref_seq:
        ref = ref_seq.generate(max_tokens=6, **options)
    with model.sequence(PROMPT) as seq:
        run = seq.run(max_tokens=6, **options)
        tokens = []
        for _ in range(3):
            tokens.extend(run.step().tokens)
        run.rewind(run.checkpoint())  # mid-generation: it goes on as if nothing happened
        while not run.is_done:
            tokens.extend(run.step().tokens)
        assert tokens == list(ref.tokens)
        end = run.checkpoint()
        run.rewind(end)  # after the end: still finished, nothing changed
        assert run.is_done and run.generator.tokens == list(ref.tokens)
        assert run.stats().rewinds == 2
