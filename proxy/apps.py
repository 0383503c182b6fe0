from django.apps import AppConfig


class ProxyConfig(AppConfig):
    name = "proxy"
    verbose_name = "Chat proxy"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from memories.sessions import clear_all_register, erasure_register
        from proxy import checks  # noqa: F401 - registers the template check
        from proxy.services import proxy_turns_clear, proxy_turns_erase

        erasure_register(proxy_turns_erase)  # wipe_user_data erases the chat turns too
        clear_all_register(proxy_turns_clear)  # clear-all: nothing queued or logged re-teaches
