"""Which adapter sources the registry accepts (container.frontend.adapters.check_source)."""

import json
import os

import pytest

from container.core.errors import InputError, describe
from container.frontend.adapters import check_source


def adapter(directory, rank=8, peft_type="LORA", weights=True):
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text(json.dumps({"r": rank, "peft_type": peft_type}))
    if weights:
        (directory / "adapter_model.safetensors").write_bytes(b"x")
    return directory


def refused(directory, roots, max_rank=8) -> str:
    with pytest.raises(InputError) as info:
        check_source(directory, [str(r) for r in roots], max_rank)
    status, _, detail = describe(info.value)
    assert status == 400 and "/" not in detail.replace("s3://", "")  # no server path in the message
    return detail


def test_an_adapter_inside_a_root_is_accepted(tmp_path):
    a = adapter(tmp_path / "root" / "a")
    assert check_source(a, [str(tmp_path / "root")], 8) == a.resolve()


def test_outside_dot_dot_and_symlinks_are_refused(tmp_path):
    root = tmp_path / "root"
    outside = adapter(tmp_path / "outside")
    root.mkdir()
    assert "outside the directories" in refused(outside, [root])
    assert "outside the directories" in refused(root / ".." / "outside", [root])
    (root / "link").symlink_to(outside)
    assert "outside the directories" in refused(root / "link", [root])
    inner = adapter(root / "inner", weights=False)
    (inner / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    assert "links out of them" in refused(inner, [root])
    assert "outside the directories" in refused(tmp_path / "root-sibling", [root])  # a prefix is not a parent


def test_missing_not_an_adapter_and_over_rank_are_refused(tmp_path):
    root = tmp_path
    assert "does not exist" in refused(root / "none", [root])
    (root / "plain").mkdir()
    assert "no adapter_config.json" in refused(root / "plain", [root])
    assert "not a LoRA adapter" in refused(adapter(root / "ia3", peft_type="IA3"), [root])
    assert "r=16 is over option.max_lora_rank=8" in refused(adapter(root / "wide", rank=16), [root])
    assert "no weights" in refused(adapter(root / "empty", weights=False), [root])
