"""Start-up check: the memory template must exist and hold `{memories}` (seed 004:
a missing template stops the process). `manage.py migrate`, which the launcher runs
before serving, runs every system check and stops on this error."""

from __future__ import annotations

from typing import Any

from django.core.checks import Error, register

from proxy.templates import TemplateProblem, memory_template_load


@register()
def memory_template_check(app_configs: Any = None, **kwargs: Any) -> list[Error]:  # noqa: ARG001 - Django API
    try:
        memory_template_load.cache_clear()
        memory_template_load()
    except TemplateProblem as problem:
        return [Error(str(problem), hint="Set PROXY_MEMORY_TEMPLATE_PATH to a readable file.", id="proxy.E001")]
    return []
