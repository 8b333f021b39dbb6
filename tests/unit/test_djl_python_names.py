"""Every public name of LMI's djl_python that handlers import exists here: the list in
tests/data/djl_python_public_names.json was taken from the real package (its source is
noted in the file); a name missing here fails this test."""

import importlib
import json
from pathlib import Path

import pytest

import djl_python

NAMES = json.loads((Path(__file__).parents[1] / "data" / "djl_python_public_names.json").read_text())


@pytest.mark.parametrize("module", sorted(NAMES["modules"]))
def test_module_has_every_public_name(module):
    imported = importlib.import_module(f"djl_python.{module}")
    missing = [name for name in NAMES["modules"][module] if not hasattr(imported, name)]
    assert missing == [], f"djl_python.{module} lacks {missing}"


@pytest.mark.parametrize("cls", sorted(NAMES["classes"]))
def test_class_has_every_public_method(cls):
    missing = [name for name in NAMES["classes"][cls] if not callable(getattr(getattr(djl_python, cls), name, None))]
    assert missing == [], f"{cls} lacks {missing}"


def test_package_exports():
    assert [name for name in NAMES["package"] if not hasattr(djl_python, name)] == []
