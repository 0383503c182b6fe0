from django.apps import AppConfig


class MemsiteConfig(AppConfig):
    name = "memsite"
    verbose_name = "Service"

    def ready(self) -> None:
        # uvicorn configured its own handlers before importing us: filter them too.
        from core.logs import install_content_filter

        install_content_filter()
