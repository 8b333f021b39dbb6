"""What a SageMaker inference toolkit script gets when it leaves things to the toolkit: the model
without model_fn (TorchScript as the PyTorch toolkit loads it, a transformers pipeline for HF_TASK as
the Hugging Face toolkit builds it, a refusal at start-up otherwise) and the answer's type without
an Accept header (SAGEMAKER_DEFAULT_INVOCATIONS_ACCEPT). The scripts are sagelmi's own."""

import io
import shutil

import numpy as np
import pytest

from tests.integration.test_inference_toolkit import _model_dir, post
from tests.server import MODEL_DIRS, Server

# the test saves and reloads TorchScript, which this torch deprecates (the PyTorch toolkit still loads it)
pytestmark = pytest.mark.filterwarnings("ignore:.*torch.jit.*:DeprecationWarning")


@pytest.fixture(scope="module")
def torchscript(tmp_path_factory):
    import torch

    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 2)

        def forward(self, x):
            return self.linear(x).tanh()

    directory = _model_dir(tmp_path_factory.mktemp("torchscript"), "sm_torchscript")
    torch.manual_seed(0)
    torch.jit.script(Scale().eval()).save(str(directory / "model.pt"))  # seeded weights, as TorchScript
    with Server(directory, env={"SAGEMAKER_DEFAULT_INVOCATIONS_ACCEPT": "text/csv"}) as server:
        server.directory = directory
        yield server


ROWS = [[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]]


def expected(directory):
    """What the TorchScript model computes here, on the same rows."""
    import torch

    with torch.no_grad():
        return torch.jit.load(str(directory / "model.pt"))(torch.tensor(ROWS)).tolist()


def test_without_model_fn_a_torchscript_model_pt_is_loaded_as_the_pytorch_toolkit_does(torchscript):
    r = post(torchscript, {"inputs": ROWS}, accept="application/json")
    assert r.status_code == 200, r.text
    assert r.headers["Content-Type"].startswith("application/json")
    assert np.allclose(r.json(), expected(torchscript.directory), atol=1e-6)
    assert "the script defines no model_fn: loading with the PyTorch toolkit's default: TorchScript from model.pt" \
        in torchscript.log()


@pytest.mark.parametrize("accept", [None, "*/*"])
def test_no_accept_or_any_answers_in_sagemaker_default_invocations_accept(torchscript, accept):
    r = post(torchscript, {"inputs": ROWS}, accept=accept)  # the server runs with text/csv as the default
    assert r.status_code == 200, r.text
    assert r.headers["Content-Type"].startswith("text/csv")
    rows = np.genfromtxt(io.StringIO(r.text), delimiter=",")
    assert np.allclose(rows, expected(torchscript.directory), atol=1e-6)


def test_without_model_fn_hf_task_builds_the_pipeline_the_hugging_face_toolkit_builds(tmp_path):
    from transformers import pipeline

    directory = _model_dir(tmp_path, "sm_hf_pipeline", "bert")
    body = {"inputs": ["what a good film", "dull and far too long"], "parameters": {"top_k": 2}}
    with Server(directory, env={"HF_TASK": "text-classification"}) as server:
        r = post(server, body)
        assert "transformers pipeline for text-classification" in server.log()
    assert r.status_code == 200, r.text
    local = pipeline(task="text-classification", model=str(directory), tokenizer=str(directory), device=-1)
    answer, want = r.json()["predictions"], local(body["inputs"], top_k=2)
    assert [[label["label"] for label in row] for row in answer] == [[label["label"] for label in row] for row in want]
    assert np.allclose([[label["score"] for label in row] for row in answer],
                       [[label["score"] for label in row] for row in want], atol=1e-5)


def test_without_model_fn_and_nothing_to_load_start_up_fails_in_one_line(tmp_path):
    directory = tmp_path / "nothing"
    shutil.copytree(MODEL_DIRS / "sm_torchscript" / "code", directory / "code")
    server = Server(directory).start(wait_ready=False)
    assert server.wait_exit(90) == 1
    assert ("the inference script defines no model_fn, and there is nothing to load without one: no HF_TASK "
            "(a transformers pipeline), no model.pt or other .pt/.pth file (TorchScript) and no config.json in the "
            "model directory") in server.log()
    assert "Traceback" not in server.log()

