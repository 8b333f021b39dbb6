"""The tiny models the tests serve (``python -m container tiny-model``), written once per machine and kept.

vLLM keys its compile cache (``~/.cache/vllm/torch_compile_cache``: the compiled model, which vLLM 0.32's
CPU build cannot load back, and inductor's cache, which makes a compile faster) by the model's path among
its settings, so a model written into each run's temporary folder never finds it. What
``tiny-model`` writes depends only on its arguments, the code that writes it and the versions of
torch, transformers and tokenizers (its weights come from a fixed seed): a model is kept under that
key in ``~/.cache/sagelmi-tests/models`` (``SAGELMI_TEST_CACHE`` moves it, as it does the offline
answers of tests/references.py), and a later run on the same machine serves it from the same path.

A kept model is shared by every lane of a run: a test that changes a model's files copies it first
(``stable_folder`` gives such a copy a path that stays the same from run to run).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

from tests.server import REPO, clean_env, tests_cache_root

WRITER = REPO / "container" / "tools" / "tiny_model.py"
DONE = "sagelmi-tiny-model.json"  # the last file tiny-model writes


def models_root() -> Path:
    """Where the models are kept (``SAGELMI_TEST_CACHE`` moves it)."""
    return tests_cache_root() / "models"


def _key(args: tuple[str, ...]) -> str:
    versions = [metadata.version(name) for name in ("torch", "transformers", "tokenizers")]
    key = json.dumps([list(args), hashlib.sha256(WRITER.read_bytes()).hexdigest(), versions])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def tiny_model(name: str, *args: str) -> Path:
    """The tiny model ``tiny-model DIR ARGS`` writes, kept as ``<models_root>/<name>-<key>``: written now
    (into a temporary folder, then renamed) unless an earlier run or another lane wrote it."""
    root = models_root()
    path = root / f"{name}-{_key(args)}"
    if (path / DONE).exists():
        return path
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one lane writes it; the others wait, then find it
        if not (path / DONE).exists():
            temporary = root / f"{path.name}.{os.getpid()}.tmp"
            shutil.rmtree(temporary, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "container", "tiny-model", str(temporary), *args], check=True,
                           cwd=REPO, env=clean_env(), capture_output=True, timeout=300)
            shutil.rmtree(path, ignore_errors=True)  # a folder left without its last file
            temporary.rename(path)
    return path


@contextlib.contextmanager
def stable_folder(name: str, fallback: Path) -> Iterator[Path]:
    """An empty folder at a path that stays the same from run to run (``<models_root>/<name>``), for a
    model the tests build from a kept one and then change (vLLM then finds its compile cache by the
    path). It is this session's while the block runs; when another session holds it (two runs on one
    machine at once), ``fallback`` instead."""
    root = models_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield fallback
            return
        path = root / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir()
        yield path
