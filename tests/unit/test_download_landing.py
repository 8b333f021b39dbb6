"""Where a downloaded file lands (container.core.artifacts.landing): inside its directory or refused."""

import pytest

from container.core.artifacts import landing


@pytest.mark.parametrize("name, expected", [
    ("config.json", "config.json"),
    ("tokenizer/vocab.txt", "tokenizer/vocab.txt"),
    ("a/../b.bin", "b.bin"),  # '..' that stays inside is only a detour
    ("a//b.bin", "a/b.bin"),
])
def test_names_inside_land_inside(tmp_path, name, expected):
    assert landing(tmp_path, name) == tmp_path / expected


@pytest.mark.parametrize("name", [
    "/etc/x",                       # the remainder of 'prefix//etc/x'
    "../x",
    "a/../../x",
    "../" * 20 + "etc/x",
    "a/..",                         # names no file
    "a/.",
    "a/",
    "",
    "a\0b",
])
def test_absolute_and_escaping_names_are_refused(tmp_path, name):
    assert landing(tmp_path, name) is None


def test_a_symbolic_link_on_the_way_out_is_refused(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "link").symlink_to(outside)
    (root / "inner").mkdir()
    (root / "inner" / "up").symlink_to(root)
    assert landing(root, "link/x") is None
    assert landing(root, "link/../x") is None  # the kernel resolves the link before '..': tmp_path/x
    assert landing(root, "inner/up/x") == root / "x"  # a link that stays inside is followed
    (root / "file").symlink_to(outside / "file")
    assert landing(root, "file") == root / "file"  # the last part is replaced by the download, not followed
