from django.apps import AppConfig


class MemsiteConfig(AppConfig):
    name = "memsite"
    verbose_name = "Service"
