"""The SDK runs on a laptop: it imports, builds and checks a model's settings
with vLLM, torch and gunicorn unimportable (a meta path finder refuses them)."""

import subprocess
import sys
import textwrap

from tests.server import REPO, clean_env

BLOCKED = ("vllm", "torch", "gunicorn", "transformers")

SCRIPT = textwrap.dedent(f"""
    import importlib.abc
    import sys

    BLOCKED = {BLOCKED!r}

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{{name}} is blocked in this test")
            return None

    sys.meta_path.insert(0, Refuse())

    from sagemaker_sdk import EngineOptionError, SagelmiModel, SettingsError
    from sagemaker_sdk.local import LocalEndpoint

    model = SagelmiModel(model_id="org/model", tensor_parallel_degree=2, options={{"max_model_len": 4096}})
    assert model.env["OPTION_MAX_MODEL_LEN"] == "4096"
    for bad, error in (({{"max_num_seq": 8}}, EngineOptionError), ({{"tensor_parallel_degree": 0}}, SettingsError)):
        try:
            SagelmiModel(model_id="org/model", options=bad)
        except error as exc:
            print(exc)
        else:
            raise AssertionError(bad)
    LocalEndpoint(model, mode="docker", image="img").command()
    loaded = sorted(name for name in sys.modules if name.split(".")[0] in BLOCKED)
    assert not loaded, loaded
    print("ok")
""")


def test_the_sdk_needs_neither_vllm_nor_torch_nor_gunicorn():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=REPO,
                            env=clean_env({"SAGEMAKER_SUPPRESS_V2_WARNING": "1"}), timeout=120)
    assert result.returncode == 0, result.stderr
    printed = [line for line in result.stdout.splitlines() if not line.startswith("sagemaker.config INFO")]
    assert printed == [
        "option.max_num_seq is neither an LMI option nor a vLLM engine argument; did you mean option.max_num_seqs, "
        "option.max_num_active_seqs, option.max_num_queued_reqs? (vLLM's engine arguments are listed at "
        "https://docs.vllm.ai/en/latest/configuration/engine_args.html)",
        "invalid setting option.tensor_parallel_degree='0' (from env OPTION_TENSOR_PARALLEL_DEGREE): Input should "
        "be greater than or equal to 1. Allowed: a whole number >= 1, or max.",
        "ok"]
