from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("proxy", "0004_sessions_replayed"),
    ]

    operations = [
        migrations.AddField(
            model_name="proxyturn",
            name="next_attempt_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="proxyturn",
            name="retry_until",
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
