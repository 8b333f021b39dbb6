"""vLLM's refusals of ``file://`` image URLs, as the vLLM handler words them for the client: the
option's name, never vLLM's command-line flag or a local path (tests/e2e/test_vision.py runs the rest)."""

import pytest
from vllm.multimodal.media.connector import MediaConnector
from vllm.multimodal.media.image import ImageMediaIO

from handlers.engines.vllm_openai import _media_error


def refusal(**connector_options) -> Exception:
    with pytest.raises(Exception) as refused:
        MediaConnector(**connector_options).load_from_url("file:///etc/hostname", ImageMediaIO())
    return refused.value


def test_a_file_url_without_an_allowed_directory_names_the_option():
    assert _media_error(refusal()) == (
        "file:// media URLs are refused unless option.allowed_local_media_path names a directory to read")


def test_a_file_outside_the_allowed_directory_is_refused_without_either_path(tmp_path):
    message = _media_error(refusal(allowed_local_media_path=str(tmp_path)))
    assert message == "a file:// media URL must name a file inside the directory option.allowed_local_media_path names"


def test_other_errors_are_left_to_vllms_own_answers():
    assert _media_error(ValueError("At most 2 image(s) may be provided in one prompt.")) is None
    assert _media_error(RuntimeError("something else")) is None
