"""Atomic writes (megatronapp/files.py): complete-or-untouched, no debris, ordinary permissions."""

from __future__ import annotations

import os
import stat

import pytest

from megatronapp.files import atomic_path, write_bytes_atomic, write_text_atomic


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_written_files_get_the_umask_permissions_not_mkstemps_0600(tmp_path):
    mask = os.umask(0)
    os.umask(mask)
    write_text_atomic(tmp_path / "a.json", "{}")
    write_bytes_atomic(tmp_path / "sub" / "b.bin", b"\x00\x01")  # the directory is created
    with atomic_path(tmp_path / "c.png") as tmp:
        assert tmp.suffix == ".png" and tmp.parent == tmp_path  # same filesystem; format by suffix
        tmp.write_bytes(b"png")
    for name in ("a.json", "sub/b.bin", "c.png"):
        assert _mode(tmp_path / name) == 0o666 & ~mask
    assert (tmp_path / "a.json").read_text() == "{}" and (tmp_path / "sub" / "b.bin").read_bytes() == b"\x00\x01"


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "summary.json"
    write_text_atomic(target, "old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("interrupted")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_two_writers_of_one_target_get_different_temporaries(tmp_path):
    with atomic_path(tmp_path / "t.txt") as a, atomic_path(tmp_path / "t.txt") as b:
        assert a != b
        a.write_text("a")
        b.write_text("b")
    assert (tmp_path / "t.txt").read_text() == "a"  # the outer block commits last
