"""Every option name of LMI's configuration pages is accepted (container/core/lmi_options.json): it is a
sagelmi setting, becomes a vLLM engine argument, goes to the chat front, or is ignored with one WARNING
line saying what sagelmi does instead. The real start with all of them: tests/e2e/test_lmi_options.py."""

import json
import logging
import re

import pytest

from container.cli import LMI_OPTIONS_PAGE, main
from container.core import lmi_options as lmi
from container.core.engine_args import (
    ENVIRONMENT,
    RENAMED,
    SPECULATIVE,
    EngineOptionError,
    check_engine_option,
    engine_environment,
    packaged_engine_args,
)
from container.core.setting_keys import KEY_BY_ALIAS, KEY_BY_NAME, option_key
from container.core.settings import resolve_settings

ENTRIES = lmi.lmi_options()
TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
# The front's names: accepted and passed on untouched; another part of sagelmi reads them (issue P11)
FRONT = {"enable_auto_tool_choice", "tool_call_parser", "tool_parser_plugin", "chat_template",
         "chat_template_content_format", "reasoning_parser", "enable_reasoning"}


@pytest.fixture
def config(tmp_path, monkeypatch, caplog):
    """``sagelmi config`` in this process on a directory holding a tiny config.json: returns
    (exit code, WARNING lines). Settings come from ``env`` and ``properties`` (serving.properties)."""
    import os

    monkeypatch.setattr("container.core.logs.configure", lambda *a, **k: None)  # keep caplog's handler
    for name in list(os.environ):
        if name.startswith(("OPTION_", "SERVING_", "HF_", "SAGEMAKER_", "SM_")):
            monkeypatch.delenv(name)
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))

    def run(env=None, properties=None):
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        if properties:
            (tmp_path / "serving.properties").write_text("".join(f"{k}={v}\n" for k, v in properties.items()))
        caplog.clear()
        with caplog.at_level(logging.INFO):
            code = main(["config", "--model-dir", str(tmp_path), "--json"])
        return code, [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    return run


def env_name(option: str) -> str:
    name = "OPTION_" + option.removeprefix("option.").upper()
    assert option_key(name[len("OPTION_") :]).lower() == option.lower()  # the container reads it back as this name
    return name


# Switches that only work with the parser they switch on (vLLM's server and LMI refuse them alone)
COMPANIONS = {
    "option.enable_auto_tool_choice": {"option.tool_call_parser": "hermes"},
    "option.enable_reasoning": {"option.reasoning_parser": "deepseek_r1"},
}


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_every_lmi_name_is_accepted_by_sagelmi_config(entry, config, capsys, tmp_path):
    if entry.name == "option.chat_template":  # a file in the model directory (config's tmp_path)
        (tmp_path / entry.example).write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    if entry.is_option:
        companions = {env_name(k): v for k, v in COMPANIONS.get(entry.name, {}).items()}
        code, warnings = config(env={env_name(entry.name): entry.example, **companions})
    else:
        code, warnings = config(properties={entry.name: entry.example})
    assert code == 0, warnings
    naming = [w for w in warnings if entry.name in w or entry.name.lower() in w]
    if entry.handling == "warn" and entry.example.lower() not in entry.silent_values:
        assert len(naming) == 1, warnings
        assert f"{entry.name} is ignored: {entry.text}" in naming[0]
    else:
        assert naming == [], warnings
    shown = json.loads(capsys.readouterr().out)
    if entry.handling == "setting" and not entry.is_option:  # a server-level name lands on its setting
        key = KEY_BY_ALIAS[entry.name].key if entry.name in KEY_BY_ALIAS else entry.name
        assert shown[key]["source"].startswith("serving.properties"), shown[key]


def test_async_mode_false_says_what_sagelmi_does(config):
    code, warnings = config(env={"OPTION_ASYNC_MODE": "false"})
    assert code == 0
    assert warnings == ["option.async_mode is ignored: sagelmi's vLLM engine is always asynchronous; answers are "
                        "the same"]


def test_server_level_names_from_the_environment_get_their_own_warning(config):
    code, warnings = config(env={"SERVING_MAX_IDLE_TIME": "60"})
    assert code == 0
    assert warnings == ["environment variable SERVING_MAX_IDLE_TIME: max_idle_time is ignored: sagelmi never scales "
                        "worker groups down"]


def test_lmi_spellings_of_the_worker_counts_are_settings(tmp_path):
    (tmp_path / "serving.properties").write_text("minWorkers=2\nmaxWorkers=3\n")
    settings = resolve_settings({}, tmp_path)
    assert (settings.min_workers, settings.max_workers) == (2, 3)


def test_names_in_no_list_are_still_refused_with_a_suggestion(config):
    """Suggestions are names that do something: not the ignored ones."""
    code, warnings = config(env={"OPTION_TOOL_CALL_PARSERS": "hermes"})
    assert code == 2
    assert any("option.tool_call_parsers is neither an LMI option nor a vLLM engine argument; did you mean "
               "option.tool_call_parser" in w for w in warnings), warnings
    code, warnings = config(env={"OPTION_ASYNC_MOD": "true"})
    assert code == 2 and not any("option.async_mode" in w for w in warnings), warnings


def test_a_model_py_gets_the_names_without_a_word(config, tmp_path):
    (tmp_path / "model.py").write_text("def handle(inputs):\n    return None\n")
    code, warnings = config(env={"OPTION_ENABLE_STATEFUL_SESSIONS": "true", "OPTION_MAX_INPUT_LEN": "10"})
    assert (code, warnings) == (0, [])


# -- the list itself ----------------------------------------------------------------------


def test_the_list_is_consistent():
    doc = json.loads(lmi.OPTIONS_FILE.read_text())
    names = [e["name"] for e in doc["options"]]
    assert len(names) == len({n.lower() for n in names}) == 244  # the research note's rows, each once
    assert re.fullmatch(r"[0-9a-f]{40}", doc["commit"])
    for entry in doc["options"]:
        assert entry["pages"] and set(entry["pages"]) <= set(doc["pages"]), entry
        assert entry["handling"] in lmi.HANDLINGS, entry
        assert entry["text"] and entry["example"] != "", entry
        assert set(entry) <= {"name", "pages", "engines", "example", "handling", "text", "silent_values"}, entry
    assert all(page["paths"] for page in doc["pages"].values())
    assert set(doc["pages"]) == {code for e in doc["options"] for code in e["pages"]}  # no page unused


def test_each_handling_is_what_the_code_does():
    engine_args = packaged_engine_args()
    for entry in ENTRIES:
        base = entry.name.removeprefix("option.")
        if entry.handling == "setting":
            assert entry.name in KEY_BY_NAME or entry.name in KEY_BY_ALIAS, entry.name
        elif entry.handling == "engine_arg":
            assert base in engine_args or base in RENAMED or base in SPECULATIVE or base in ENVIRONMENT \
                or base == "dtype", entry.name
        elif entry.handling == "front":
            assert base in FRONT
        else:
            assert entry.is_option or entry.name not in KEY_BY_NAME, entry.name
            assert "#" not in entry.text and "container/" not in entry.text  # written for a user
    assert {e.name.removeprefix("option.") for e in ENTRIES if e.handling == "front"} == FRONT


def test_the_reference_page_is_current():
    assert LMI_OPTIONS_PAGE.read_text() == lmi.reference_page(), "regenerate it: python -m container lmi-options --write"
    for entry in ENTRIES:
        assert f"| `{entry.name}` |" in lmi.reference_page()


def test_lmi_options_command_prints_the_page(capsys):
    assert main(["lmi-options"]) == 0
    assert capsys.readouterr().out == lmi.reference_page()


# -- option.lmcache_config_file -> LMCACHE_CONFIG_FILE ----------------------------------------


def test_lmcache_config_file_becomes_the_worker_groups_environment(tmp_path):
    (tmp_path / "lmcache.yaml").write_text("chunk_size: 256\n")
    settings = resolve_settings({"OPTION_LMCACHE_CONFIG_FILE": "lmcache.yaml"}, tmp_path)
    assert engine_environment(settings) == {"LMCACHE_CONFIG_FILE": str(tmp_path / "lmcache.yaml")}
    absolute = resolve_settings({"OPTION_LMCACHE_CONFIG_FILE": str(tmp_path / "lmcache.yaml")}, "/nonexistent")
    assert engine_environment(absolute) == {"LMCACHE_CONFIG_FILE": str(tmp_path / "lmcache.yaml")}
    assert engine_environment(resolve_settings({}, tmp_path)) == {}
    with pytest.raises(EngineOptionError, match=r"option.lmcache_config_file='missing.yaml': no such file"):
        engine_environment(resolve_settings({"OPTION_LMCACHE_CONFIG_FILE": "missing.yaml"}, tmp_path))
    check_engine_option("lmcache_config_file", "lmcache.yaml")


@pytest.mark.parametrize("switch", sorted(COMPANIONS))
def test_a_parser_switch_without_its_parser_is_refused_in_one_line(switch, config):
    code, warnings = config(env={env_name(switch): "true"})
    assert code == 2
    (needed,) = COMPANIONS[switch]
    assert warnings == [f"{switch}=true needs {needed}" + warnings[0].split(needed, 1)[1]]
