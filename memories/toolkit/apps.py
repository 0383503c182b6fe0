from django.apps import AppConfig


class ToolkitConfig(AppConfig):
    """Seed 003's toolkit (issue 14): the semantic cache and decisions live here; its
    memories are ordinary engine rows."""

    name = "memories.toolkit"
    label = "toolkit"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from memories.sessions import clear_all_register, derived_answers_register
        from memories.toolkit.services import toolkit_cache_user_drop

        # A cached answer would hand cleared, deleted or replaced facts back.
        clear_all_register(toolkit_cache_user_drop)
        derived_answers_register(toolkit_cache_user_drop)
