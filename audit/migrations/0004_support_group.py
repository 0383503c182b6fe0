"""Create the `support` group (see audit/support.py)."""

from django.db import migrations

from audit.support import SUPPORT_GROUP, support_group_ensure


def create_support_group(apps, schema_editor):
    from django.contrib.auth.management import create_permissions

    # Permissions are normally created after all migrations; the group needs them now.
    for app_config in apps.get_app_configs():
        app_config.models_module = True
        create_permissions(app_config, apps=apps, verbosity=0)
        app_config.models_module = None

    support_group_ensure(apps.get_model("auth", "Group"), apps.get_model("auth", "Permission"))


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
