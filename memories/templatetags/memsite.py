from datetime import datetime

from django import template

register = template.Library()


@register.filter
def when(value) -> str:
    """An engine timestamp (ISO-8601 text) as 'YYYY-MM-DD HH:MM UTC'."""
    if not value:
        return ""
    try:
        return datetime.fromisoformat(str(value)).strftime("%Y-%m-%d %H:%M UTC")
    except ValueError:
        return str(value)
