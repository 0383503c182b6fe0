"""Marks the session logs the chat proxy wrote before `SessionState.replayed` existed, from
its turn rows (which clear-all read until then), so pruning those rows loses nothing."""

from django.db import migrations


def mark_replayed(apps, schema_editor):
    ProxyTurn = apps.get_model("proxy", "ProxyTurn")
    SessionState = apps.get_model("memories", "SessionState")
    SessionEvent = apps.get_model("memories", "SessionEvent")
    seen = ProxyTurn.objects.values_list("user_id", "tenant", "session_id").distinct()
    for user_id, tenant, session_id in seen.iterator(chunk_size=2000):
        owned = {"engine_user_id": f"{tenant}:{user_id}", "project": "", "session_id": session_id}
        if SessionState.objects.filter(**owned).update(replayed=True):
            continue
        # A log written before every writer kept a state row has none yet: it gets one.
        if SessionEvent.objects.filter(**owned).exists():
            SessionState.objects.create(**owned, replayed=True)


class Migration(migrations.Migration):
    dependencies = [
        ("proxy", "0003_actor_credential"),
        ("memories", "0024_session_state_replayed"),
    ]

    operations = [migrations.RunPython(mark_replayed, migrations.RunPython.noop)]
