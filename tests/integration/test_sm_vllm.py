"""``sagelmi config``, the real command, shows AWS's vLLM-container variables (``SM_VLLM_<ARG>``) as the
settings they are, each with its variable as the source, and refuses a name vLLM has no argument for
in one line. No engine starts. (``sagelmi serve``: tests/integration/test_engine_options.py.)"""

import json

from tests.readme import run_shell

DOC_COMMAND = "SM_VLLM_MAX_MODEL_LEN=300 sagelmi config"  # docs/configuration.md


def _rows(stdout: str) -> dict[str, str]:
    return {line.split()[0]: line for line in stdout.splitlines()[1:] if line.strip()}


def test_config_shows_an_sm_vllm_argument_with_its_variable_as_the_source():
    result = run_shell(DOC_COMMAND, port=8080)
    assert result.returncode == 0, result.stderr
    row = _rows(result.stdout)["option.max_model_len"].split()
    assert row[1] == "300" and row[2:4] == ["env", "SM_VLLM_MAX_MODEL_LEN"], row

    result = run_shell("SM_VLLM_MAX_MODEL_LEN=300 SM_VLLM_TENSOR_PARALLEL_SIZE=1 sagelmi config --json", port=8080)
    shown = json.loads(result.stdout)
    assert shown["option.max_model_len"]["value"] == "300"
    assert shown["option.tensor_parallel_degree"] == {"value": "1", "source": "env SM_VLLM_TENSOR_PARALLEL_SIZE"}


def test_config_refuses_a_name_vllm_has_no_argument_for_in_one_line():
    result = run_shell("SM_VLLM_MAX_MODEL_LENN=300 SM_VLLM_HF_TOKEN=hf_not_shown sagelmi config", port=8080)
    assert result.returncode == 2
    assert result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert "ERROR" in line and "SM_VLLM_MAX_MODEL_LENN names --max-model-lenn" in line, line
    assert "did you mean SM_VLLM_MAX_MODEL_LEN" in line and "hf_not_shown" not in line
