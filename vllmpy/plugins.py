"""Out-of-tree plugins (vLLM's general_plugins seam, under our own entry-point group): a package lists
`[project.entry-points."vllmpy.general_plugins"] name = "pkg.module:register"` and `register()` runs once,
at engine start, before the first architecture lookup; it typically calls
`vllmpy.ModelRegistry.register_model("MyArchForCausalLM", "pkg.model:MyModel")`.

$VLLMPY_PLUGINS (comma-separated entry-point names) limits which load, as vLLM's VLLM_PLUGINS. A plugin
that fails is named in one error line and skipped: the engine serves what it has.
"""
from __future__ import annotations

import functools
import logging
import os
from importlib.metadata import entry_points

PLUGIN_GROUP = "vllmpy.general_plugins"
logger = logging.getLogger("vllmpy")


@functools.cache  # once per process
def load_general_plugins() -> list[str]:
    """Run every installed plugin's entry point; returns the names that loaded."""
    allowed = os.environ.get("VLLMPY_PLUGINS")
    wanted = None if allowed is None else {name.strip() for name in allowed.split(",") if name.strip()}
    loaded = []
    for entry in entry_points(group=PLUGIN_GROUP):
        if wanted is not None and entry.name not in wanted:
            continue
        try:
            entry.load()()
        except Exception as exc:  # a broken plugin must not take the engine down, nor flood the log
            logger.error("plugin %r (%s = %s) failed and was skipped: %s: %s", entry.name, PLUGIN_GROUP,
                         entry.value, type(exc).__name__, exc)
            continue
        loaded.append(entry.name)
        logger.info("plugin %r loaded", entry.name)
    return loaded
