"""Start-up check: a worker's lease on the usage events it sends must outlast the POST
that sends them (billing/services.py starts a POST only with 2 x USAGE_DELIVERY_TIMEOUT_S
of lease left: the POST's total deadline, and as long again to record its result). A
shorter lease sends nothing from a refused batch, and lets a second worker claim events
whose POST is still in flight. `manage.py migrate`, which the launcher runs before
serving, stops on this error."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import Error, register


@register()
def usage_delivery_lease_check(app_configs: Any = None, **kwargs: Any) -> list[Error]:  # noqa: ARG001 - Django API
    lease, timeout = settings.USAGE_CLAIM_LEASE_S, settings.USAGE_DELIVERY_TIMEOUT_S
    if lease > 2 * timeout:
        return []
    return [
        Error(
            f"USAGE_CLAIM_LEASE_S ({lease}) must be more than twice USAGE_DELIVERY_TIMEOUT_S ({timeout}).",
            hint="A worker starts a POST only if its lease outlasts it; raise the lease or lower the timeout.",
            id="billing.E001",
        )
    ]
