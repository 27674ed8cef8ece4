"""Out-of-tree models: a plugin package (written here, with a dist-info entry point in the
`vllmpy.general_plugins` group, put on sys.path) registers a new architecture — a Llama subclass under its
own name — which then generates offline and serves over HTTP; a broken plugin is one error line."""
from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from vllmpy import LLM, ModelRegistry, SamplingParams
from vllmpy.plugins import PLUGIN_GROUP, load_general_plugins

ARCH = "TinyPluginLlamaForCausalLM"
_PACKAGE = '''
def register():
    from vllmpy import ModelRegistry
    ModelRegistry.register_model("TinyPluginLlamaForCausalLM", "tiny_plugin.model:TinyPluginLlama")
'''
_MODEL = '''
from vllmpy.models.llama import LlamaForCausalLM


class TinyPluginLlama(LlamaForCausalLM):
    built = 0

    def __init__(self, config):
        super().__init__(config)
        type(self).built += 1
'''


def write_plugin(root: Path, entry_points: dict[str, str]) -> Path:
    """tiny_plugin (package) + a dist-info whose entry_points.txt lists `entry_points` (name → target)."""
    (root / "tiny_plugin").mkdir(parents=True)
    (root / "tiny_plugin" / "__init__.py").write_text(_PACKAGE)
    (root / "tiny_plugin" / "model.py").write_text(_MODEL)
    info = root / "tiny_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tiny-plugin\nVersion: 0.1\n")
    lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[{PLUGIN_GROUP}]\n{lines}")
    return root


@pytest.fixture
def plugin_env(tmp_path, monkeypatch):
    """A fresh registry and plugin loader, the plugin on sys.path; everything undone afterwards."""
    root = write_plugin(tmp_path / "site", {"tiny": "tiny_plugin:register", "broken": "no_such_pkg.x:register"})
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()
    monkeypatch.setattr(ModelRegistry, "_models", dict(ModelRegistry._models))
    load_general_plugins.cache_clear()
    yield root
    load_general_plugins.cache_clear()


@pytest.fixture
def plugin_checkpoint(tiny_llama_dir, tmp_path) -> str:
    path = tmp_path / "plugin_ckpt"
    shutil.copytree(tiny_llama_dir, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": [ARCH]}))
    return str(path)


def _greedy(llm: LLM) -> list[int]:
    output = llm.generate("Hello there", SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0]
    return output.outputs[0].token_ids


def test_plugin_registers_an_architecture_that_generates(plugin_env, plugin_checkpoint, tiny_llama_dir, caplog):
    with caplog.at_level(logging.ERROR, logger="vllmpy"):
        llm = LLM(plugin_checkpoint, max_model_len=128, num_blocks=32)
    from tiny_plugin.model import TinyPluginLlama

    assert type(llm.engine.core.model) is TinyPluginLlama and TinyPluginLlama.built == 1
    assert ARCH in ModelRegistry.get_supported_archs()
    assert _greedy(llm) == _greedy(LLM(tiny_llama_dir, max_model_len=128, num_blocks=32))  # same weights
    # The broken plugin: one error line naming it, no traceback; the engine started regardless.
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is None
    assert "'broken'" in errors[0].getMessage() and "ModuleNotFoundError" in errors[0].getMessage()
    assert load_general_plugins() == ["tiny"]  # loaded once: the cached result, no second run


def test_register_model_accepts_a_class_and_refuses_bad_targets(plugin_env, plugin_checkpoint, monkeypatch):
    from vllmpy.models.llama import LlamaForCausalLM

    class ClassForm(LlamaForCausalLM):
        pass

    ModelRegistry.register_model(ARCH, ClassForm)
    monkeypatch.setenv("VLLMPY_PLUGINS", "")  # no entry point runs: the class registered above stays
    llm = LLM(plugin_checkpoint, max_model_len=128, num_blocks=32)
    assert type(llm.engine.core.model) is ClassForm
    with pytest.raises(ValueError, match="model_cls must be a class or 'module:ClassName'"):
        ModelRegistry.register_model("X", "no_colon_here")
    with pytest.raises(ValueError, match="CausalLM subclass"):
        ModelRegistry.register_model("X", dict)


def test_unimportable_registered_path_is_named(plugin_env, plugin_checkpoint, monkeypatch):
    ModelRegistry.register_model(ARCH, "missing_module:Model")
    monkeypatch.setenv("VLLMPY_PLUGINS", "")
    with pytest.raises(ValueError, match=f"{ARCH}.*'missing_module:Model'.*cannot be imported"):
        LLM(plugin_checkpoint, max_model_len=128, num_blocks=32)


def test_plugin_architecture_serves(plugin_env, plugin_checkpoint):
    httpx = pytest.importorskip("httpx")
    from tests.server.conftest import ServerProcess

    env = {"PYTHONPATH": os.pathsep.join([str(plugin_env), os.environ.get("PYTHONPATH", "")])}
    server = ServerProcess("--model", plugin_checkpoint, "--num-blocks", "32", "--max-model-len", "128", env=env)
    try:
        answer = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=30)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
        assert "plugin 'broken'" in server.stderr and "Traceback" not in server.stderr
    finally:
        server.stop()
