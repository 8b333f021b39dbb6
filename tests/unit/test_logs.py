"""The log's two safety rules (container/core/logs.py): secrets are shown as ***, and what a
client sent cannot start a line of the text log."""

import logging

import pytest

from container.core import logs
from container.core.settings import describe_settings, resolve_settings

TOKEN = "hf_aVeryPrivateTokenValue1234"


@pytest.mark.parametrize("name", [
    "hf_token", "option.hf_token", "OPTION_HF_TOKEN", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "option.use_auth_token",
    "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "SAGELMI_CLUSTER_SECRET", "api_key", "OPENAI_API_KEY", "apiKey",
    "db_password", "credentials", "Authorization", "key",
])
def test_names_that_hold_secrets(name):
    assert logs.is_secret(name)


@pytest.mark.parametrize("name", [
    "max_rolling_batch_prefill_tokens", "option.max_rolling_batch_prefill_tokens", "max_tokens", "tokenizer",
    "option.sink_token_length", "option.smoothquant_per_token", "skip_special_tokens", "AWS_ACCESS_KEY_ID",
    "AWS_REGION", "model_id", "kv_transfer_config",
])
def test_names_that_do_not(name):
    assert not logs.is_secret(name)


def test_redacted_keeps_the_keys_and_what_is_unset_and_goes_into_nested_configs():
    given = {"hf_token": TOKEN, "model": "/opt/ml/model", "api_key": None, "max_num_seqs": 4,
             "watermark_config": {"key": 42, "alpha": 0.1}, "kv_transfer_config": {"extra": [{"password": "p"}]}}
    assert logs.redacted(given) == {"hf_token": "***", "model": "/opt/ml/model", "api_key": None, "max_num_seqs": 4,
                                    "watermark_config": {"key": "***", "alpha": 0.1},
                                    "kv_transfer_config": {"extra": [{"password": "***"}]}}
    assert given["hf_token"] == TOKEN  # a copy


def test_settings_rows_show_secrets_as_stars(tmp_path):
    """What `sagelmi config` prints and `sagelmi serve` logs ("setting option.hf_token=...")."""
    settings = resolve_settings({"OPTION_HF_TOKEN": TOKEN, "OPTION_MY_DB_PASSWORD": "pw", "OPTION_HF_TOKEN_NOTE": "x"},
                                str(tmp_path))
    rows = {key: (value, source) for key, value, source in describe_settings(settings)}
    assert rows["option.hf_token"] == ("***", "env OPTION_HF_TOKEN (passed to the handler)")
    assert rows["option.my_db_password"][0] == "***" and rows["option.hf_token_note"][0] == "x"
    assert settings.options["hf_token"] == TOKEN  # the handler and the engine get it


def test_command_lines_hide_secret_assignments_and_flag_values():
    words = ["mpirun", "-x", "HF_TOKEN", "-x", f"HF_TOKEN={TOKEN}", "--hf-token", TOKEN, f"--api-key={TOKEN}",
             "--map-by", "slot", "NAME=v"]
    assert logs.redacted_command(words) == ["mpirun", "-x", "HF_TOKEN", "-x", "HF_TOKEN=***", "--hf-token", "***",
                                            "--api-key=***", "--map-by", "slot", "NAME=v"]


def _text_log(capsys, emit) -> list[str]:
    logs.configure("frontend", "INFO", "text")  # its handler is taken out after the test (tests/conftest.py)
    emit(logging.getLogger("sagelmi.test"))
    return capsys.readouterr().err.splitlines()


FORGED = "1999-01-01 00:00:00,000 INFO frontend [forged] sagelmi.frontend: forged"


def test_control_characters_in_a_logged_value_cannot_start_a_line(capsys):
    token = logs.request_id_var.set("id\x1b[2J")

    def emit(log):
        log.info("GET %s -> 404", f"/nowhere\r\n{FORGED}\u2028{FORGED}\x85x\ty")

    try:
        lines = _text_log(capsys, emit)
    finally:
        logs.request_id_var.reset(token)
    assert len(lines) == 1
    assert lines[0].endswith(f"frontend [id\\x1b[2J] sagelmi.test: GET /nowhere\\r\\n{FORGED}\\u2028{FORGED}\\x85x\ty -> 404")


def test_a_traceback_is_indented_below_its_record(capsys):
    def emit(log):
        try:
            raise ValueError(f"bad input\n{FORGED}")
        except ValueError:
            log.exception("handler failed")

    lines = _text_log(capsys, emit)
    assert "handler failed" in lines[0] and not lines[0].startswith(" ")
    assert len(lines) > 3 and all(line.startswith("    ") for line in lines[1:])
    assert lines[-1] == f"    {FORGED}" and lines[1] == "    Traceback (most recent call last):"


def test_the_json_format_is_one_line_per_record(capsys):
    logs.configure("frontend", "INFO", "json")
    logging.getLogger("sagelmi.test").info("GET %s", f"/x\n{FORGED}")
    assert len(capsys.readouterr().err.splitlines()) == 1
