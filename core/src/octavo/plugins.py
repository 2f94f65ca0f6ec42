"""The plugin manager: hook specs + built-in plugins + entry points of group ``octavo``.

Environment (declared in ``octavo.envs``): ``OCTAVO_PLUGINS`` allow-lists entry-point names,
``OCTAVO_DISABLE_PLUGINS`` blocks some, ``OCTAVO_TRACE_HOOKS=1`` logs every hook call.
"""

from __future__ import annotations

import importlib.metadata
import logging
from typing import Any, TypeVar

import pluggy

from octavo import envs, hookspecs

T = TypeVar("T")
logger = logging.getLogger(__name__)
_trace_logger = logging.getLogger("octavo.hooks")

ENTRY_POINT_GROUP = "octavo"
_BUILTIN_PLUGINS = (
    "octavo.model_executor.models.builtin_plugin",
    "octavo.model_executor.layers.quantization.builtin_plugin",
    "octavo.sample.builtin_logits_processors",
    "octavo.reasoning.builtin_plugin",
    "octavo.entrypoints.openai.tool_parsers.builtin_plugin",
)


def build_plugin_manager(load_entry_points: bool = True) -> pluggy.PluginManager:
    """A fresh plugin manager with Octavo's specs, built-in plugins and installed plugins.

    Raises ``pluggy.PluginValidationError`` when a plugin implements a hook that does not
    exist (e.g. a misspelled name): ``check_pending()`` catches it at start-up.
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    for module_name in _BUILTIN_PLUGINS:
        module = importlib.import_module(module_name)
        pm.register(module, name=module_name)
    if load_entry_points:
        _load_entry_points(pm)
    pm.check_pending()
    if envs.trace_hooks():
        _enable_tracing(pm)
    return pm


_default_pm: pluggy.PluginManager | None = None


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, built on first use."""
    global _default_pm
    if _default_pm is None:
        _default_pm = build_plugin_manager()
    return _default_pm


def registered_classes(hook: Any, kind: str, base: type[T]) -> dict[str, type[T]]:
    """Call a ``register(name, cls)`` hook (``pm.hook.octavo_register_...``) and return what
    the plugins registered, by name; a later registration of a name wins, so a plugin can
    replace a built-in. ``kind`` names the things in errors ("tool-call parser"); a name
    that is not a non-empty string is a ``ValueError``, a class that is not a subclass of
    ``base`` a ``TypeError``."""
    found: dict[str, type[T]] = {}

    def register(name: str, cls: Any) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {kind} needs a non-empty name, got {name!r}")
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise TypeError(f"{kind} {name!r} must be a subclass of "
                            f"{base.__module__}.{base.__qualname__}, got {cls!r}")
        found[name] = cls

    hook(register=register)
    return found


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    allow = envs.plugin_allow_list()
    block = envs.plugin_block_list()
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in block or (allow is not None and ep.name not in allow):
            logger.debug("plugin %s (%s) not loaded: blocked by environment", ep.name, ep.value)
            continue
        if pm.get_plugin(ep.name) is not None or pm.is_blocked(ep.name):
            continue
        dist = getattr(ep, "dist", None)
        source = f"{ep.value} of {dist.name}" if dist else ep.value
        try:
            plugin = ep.load()
        except Exception as exc:
            # One broken plugin must say which it is and how to run without it.
            raise RuntimeError(
                f"Octavo plugin {ep.name!r} ({source}) failed to import: {exc!r}. Fix or "
                f"uninstall it, or skip it with OCTAVO_DISABLE_PLUGINS={ep.name}."
            ) from exc
        pm.register(plugin, name=ep.name)
        logger.debug("loaded plugin %s (%s)", ep.name, source)


def _enable_tracing(pm: pluggy.PluginManager) -> None:
    def before(hook_name, hook_impls, kwargs):
        plugins = [impl.plugin_name for impl in hook_impls]
        _trace_logger.debug("call %s(%s) on %s", hook_name, ", ".join(kwargs), plugins)

    def after(outcome, hook_name, hook_impls, kwargs):
        try:
            result = outcome.get_result()
        except BaseException as exc:
            _trace_logger.debug("%s raised %r", hook_name, exc)
        else:
            _trace_logger.debug("%s -> %r", hook_name, result)

    pm.add_hookcall_monitoring(before, after)
