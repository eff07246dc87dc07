"""The wheel carries the registry and the grammars, not only an editable checkout."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_contains_data_files(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("lcgen-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "lcgen/models.toml" in names
    shipped = {p.relative_to(ROOT).as_posix() for p in (ROOT / "grammars").iterdir()}
    assert shipped and {f"lcgen/{name}" for name in shipped} <= names
    assert "lcgen/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)  # MIT, as declared
    assert not any(n.startswith(("tests/", "bench/", ".venv")) for n in names)
