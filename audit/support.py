"""The `support` group: staff who may look at everything in the admin and change nothing."""

SUPPORT_GROUP = "support"
VIEWABLE = {
    "audit": ["auditevent", "memoryhistory", "auditexportbatch"],
    "memories": ["enginememoryrow", "apikey", "ratewindow", "externalidentity", "contenthash"],
    "billing": ["usageevent"],
    "auth": ["user"],
}


def support_group_ensure(group_model, permission_model):
    """Create or repair the group. Takes the model classes, so migrations can pass theirs."""
    group, _ = group_model.objects.get_or_create(name=SUPPORT_GROUP)
    codenames = [f"view_{model}" for models in VIEWABLE.values() for model in models]
    group.permissions.set(permission_model.objects.filter(codename__in=codenames, content_type__app_label__in=VIEWABLE))
    return group
