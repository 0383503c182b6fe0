from django.apps import AppConfig


class ProxyConfig(AppConfig):
    name = "proxy"
    verbose_name = "Chat proxy"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from proxy import checks  # noqa: F401 - registers the template check
