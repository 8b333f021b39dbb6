"""handlers/engines/vllm_plugin.py patches vLLM's model runner when vLLM imports it, not in every
process it is loaded in (the EngineCore never imports the runner: 0.2-0.6 s of start-up each)."""

import inspect
import subprocess
import sys
import textwrap

import pytest

from handlers.engines import vllm_plugin
from tests.server import REPO, clean_env


@pytest.fixture
def fake_module(tmp_path, monkeypatch):
    """A module ``sagelmi_fake_runner`` that is not imported yet."""
    (tmp_path / "sagelmi_fake_runner.py").write_text("class Runner:\n    def step(self):\n        return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    yield "sagelmi_fake_runner"
    sys.modules.pop("sagelmi_fake_runner", None)


def _hooks(name: str) -> list:
    """The import hooks waiting for ``name`` (vLLM's own, for its model runner, may wait beside them: an earlier
    test that built a vLLM configuration in this process loaded the plugin)."""
    return [f for f in sys.meta_path if isinstance(f, vllm_plugin._AfterImport) and f.name == name]


def test_a_module_is_patched_when_it_is_imported_and_only_once(fake_module):
    patched = []
    vllm_plugin._after_import(fake_module, patched.append)
    vllm_plugin._after_import(fake_module, patched.append)  # a second register(): no second hook
    assert patched == [] and fake_module not in sys.modules

    module = __import__(fake_module)
    assert patched == [module]
    assert not _hooks(fake_module)  # used once, then gone
    assert "def step" in inspect.getsource(module.Runner)  # the module's own loader still answers


def test_a_module_already_imported_is_patched_at_once(fake_module):
    module = __import__(fake_module)
    patched = []
    vllm_plugin._after_import(fake_module, patched.append)
    assert patched == [module]
    assert not _hooks(fake_module)


@pytest.mark.slow  # imports vLLM's model runner in a new interpreter (10-20 s)
def test_with_real_vllm_register_leaves_the_runner_unimported_and_patches_it_on_import():
    pytest.importorskip("vllm")
    script = textwrap.dedent("""
        import sys
        import vllm
        from vllm.platforms import current_platform
        if not (current_platform.is_cpu() and vllm.__version__.startswith("0.32.")):
            print("not-applicable"); sys.exit(0)
        from handlers.engines import vllm_plugin
        vllm_plugin.register()
        print("imported-by-register", "vllm.v1.worker.gpu_model_runner" in sys.modules)
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
        print("patched", getattr(CPUModelRunner._bookkeeping_sync, vllm_plugin._PATCHED, False))
    """)
    env = {**clean_env(), "VLLM_PLUGINS": ""}  # vLLM itself loads no plugin: the script calls register()
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    if "not-applicable" in result.stdout:
        pytest.skip("the plugin only patches vLLM 0.32's CPU build")
    assert "imported-by-register False" in result.stdout
    assert "patched True" in result.stdout
