from django.apps import AppConfig


class ToolkitConfig(AppConfig):
    """Seed 003's toolkit (issue 14): the semantic cache and decisions live here; its
    memories are ordinary engine rows."""

    name = "memories.toolkit"
    label = "toolkit"
    default_auto_field = "django.db.models.BigAutoField"
