"""No tracked file points outside the repository: a user's clone has nothing beside it, so a
path like `../shared/tools/...` in a doc, test or script is a path that does not exist there."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# A relative path that climbs at least one folder, e.g. ../x or ../../a/b.
UP_PATH = re.compile(r"(?<![\w./-])((?:\.\./)+[\w.-]*)")


def tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    files = [ROOT / name for name in out.decode().split("\0") if name]
    return [f for f in files if f.is_file() and b"\0" not in f.read_bytes()[:4096]]


def escapes_repository(path_text: str, folder: Path) -> bool:
    """`path_text` resolved against `folder` (where a link or import is read from) and against the
    root (where the README's commands run) leaves the repository either way."""
    escapes = []
    for base in (folder, ROOT):
        resolved = os.path.normpath(os.path.join(os.path.relpath(base, ROOT), path_text))
        escapes.append(resolved == ".." or resolved.startswith("../"))
    return all(escapes)


def test_compute_escape_of_relative_paths():
    assert escapes_repository("../shared/tools/check", ROOT)
    assert escapes_repository("../../x", ROOT / "tests")
    assert not escapes_repository("../t/timeline.json", ROOT / "tests" / "scan")
    assert not escapes_repository("../views/a.js", ROOT / "megatronapp" / "scope_ui" / "static" / "views")


def test_no_tracked_file_refers_to_a_path_outside_the_repository():
    found = []
    for path in tracked_text_files():
        if path == Path(__file__).resolve():  # its own examples
            continue
        text = path.read_text(errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            if "shared/tools" in line:
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
                continue
            for match in UP_PATH.finditer(line):
                if escapes_repository(match.group(1), path.parent):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    assert not found, "paths outside the repository:\n" + "\n".join(found)
