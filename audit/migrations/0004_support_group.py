"""The `support` group: staff who may look at everything in the admin and change nothing."""

from django.db import migrations

SUPPORT_GROUP = "support"
VIEWABLE = {
    "audit": ["auditevent", "memoryhistory", "auditexportbatch"],
    "memories": ["enginememoryrow", "apikey", "ratewindow", "externalidentity", "contenthash"],
    "billing": ["usageevent"],
    "auth": ["user"],
}


def create_support_group(apps, schema_editor):
    from django.contrib.auth.management import create_permissions

    # Permissions are normally created after all migrations; the group needs them now.
    for app_config in apps.get_app_configs():
        app_config.models_module = True
        create_permissions(app_config, apps=apps, verbosity=0)
        app_config.models_module = None

    Group = apps.get_model("auth", "Group")
    Permission = apps.get_model("auth", "Permission")
    group, _ = Group.objects.get_or_create(name=SUPPORT_GROUP)
    codenames = [f"view_{model}" for models in VIEWABLE.values() for model in models]
    group.permissions.set(Permission.objects.filter(codename__in=codenames, content_type__app_label__in=VIEWABLE))


def remove_support_group(apps, schema_editor):
    apps.get_model("auth", "Group").objects.filter(name=SUPPORT_GROUP).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("audit", "0003_append_only"),
        ("auth", "0012_alter_user_first_name_max_length"),
        ("billing", "0001_initial"),
        ("memories", "0004_paging_index"),
    ]

    operations = [migrations.RunPython(create_support_group, remove_support_group)]
