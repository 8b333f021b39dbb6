"""The tiny models kept between runs (tests/models.py): one path per model, written once."""

import json

from tests import models


def test_a_model_is_written_once_kept_at_a_path_its_arguments_name_and_rewritten_when_torn(tmp_path, monkeypatch):
    monkeypatch.setenv("SAGELMI_TEST_CACHE", str(tmp_path))
    first = models.tiny_model("tiny", "--max-model-len", "256")
    assert first.parent == tmp_path / "models" and first.name.startswith("tiny-")
    assert json.loads((first / models.DONE).read_text())["max_model_len"] == 256
    written = (first / "model.safetensors").stat().st_mtime_ns
    assert models.tiny_model("tiny", "--max-model-len", "256") == first  # kept: the same path, not rewritten
    assert (first / "model.safetensors").stat().st_mtime_ns == written
    assert models._key(("--max-model-len", "512")) != models._key(("--max-model-len", "256"))  # another model

    (first / models.DONE).unlink()  # as a run stopped while writing it would leave it
    assert models.tiny_model("tiny", "--max-model-len", "256") == first
    assert (first / models.DONE).exists() and (first / "model.safetensors").stat().st_mtime_ns != written
    assert [p.name for p in (tmp_path / "models").iterdir() if p.is_dir()] == [first.name]  # no temporary left


def test_a_stable_folder_is_emptied_for_its_session_and_another_session_at_once_gets_its_fallback(tmp_path,
                                                                                                  monkeypatch):
    monkeypatch.setenv("SAGELMI_TEST_CACHE", str(tmp_path))
    with models.stable_folder("lora", tmp_path / "a") as folder:
        assert folder == tmp_path / "models" / "lora" and list(folder.iterdir()) == []
        (folder / "left").touch()
        with models.stable_folder("lora", tmp_path / "b") as other:
            assert other == tmp_path / "b"  # held by the session above
    with models.stable_folder("lora", tmp_path / "c") as folder:
        assert folder == tmp_path / "models" / "lora" and list(folder.iterdir()) == []  # emptied again
