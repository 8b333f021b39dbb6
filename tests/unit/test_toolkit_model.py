"""Which model a toolkit script without model_fn gets (handlers/api/toolkit_model.py), decided from
the model directory and HF_TASK alone, as the toolkits decide it."""

import json

import pytest

from handlers.api.toolkit_model import default_model_loader, task_of_architecture


def _config(directory, architecture):
    (directory / "config.json").write_text(json.dumps({"architectures": [architecture]}))


@pytest.mark.parametrize(("architecture", "task"), [
    ("BertForSequenceClassification", "text-classification"),
    ("DistilBertForTokenClassification", "token-classification"),
    ("LlamaForCausalLM", "text-generation"),
    ("T5ForConditionalGeneration", "text2text-generation"),
    ("TapasForQuestionAnswering", "table-question-answering"),
    ("RobertaForQuestionAnswering", "question-answering"),
    ("BertForMaskedLM", "fill-mask"),
])
def test_the_task_is_the_one_the_architecture_names(tmp_path, architecture, task):
    _config(tmp_path, architecture)
    assert task_of_architecture(tmp_path / "config.json") == task
    assert f"pipeline for {task}" in default_model_loader(str(tmp_path), None).__doc__


def test_an_architecture_without_a_task_asks_for_hf_task(tmp_path):
    _config(tmp_path, "BertModel")
    with pytest.raises(ValueError, match="cannot be inferred from the architecture BertModel in config.json: set HF_TASK"):
        default_model_loader(str(tmp_path), None)


def test_hf_task_wins_then_torchscript_then_config(tmp_path):
    _config(tmp_path, "BertForMaskedLM")
    (tmp_path / "weights.pth").write_bytes(b"")
    assert "pipeline for summarization" in default_model_loader(str(tmp_path), "summarization").__doc__
    assert "TorchScript from weights.pth" in default_model_loader(str(tmp_path), None).__doc__
    (tmp_path / "model.pt").write_bytes(b"")
    assert "TorchScript from model.pt" in default_model_loader(str(tmp_path), None).__doc__  # model.pt first


def test_several_weight_files_without_model_pt_are_refused(tmp_path):
    (tmp_path / "a.pt").write_bytes(b"")
    (tmp_path / "b.pth").write_bytes(b"")
    with pytest.raises(ValueError, match=r"exactly one .pt or .pth file is needed .* \['a.pt', 'b.pth'\]"):
        default_model_loader(str(tmp_path), None)


def test_an_empty_directory_is_refused_naming_what_was_looked_for(tmp_path):
    with pytest.raises(ValueError, match="defines no model_fn, and there is nothing to load without one"):
        default_model_loader(str(tmp_path), None)
