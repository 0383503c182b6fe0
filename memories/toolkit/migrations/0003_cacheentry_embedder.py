"""Cache rows record the embedder that made their embedding (`EmbedderSpec.label`), so
check_cache compares a query only with rows of the same embedder. Existing rows get ""
(unknown): which embedder made each is not knowable here (a re-embedding may have
switched it since, and cache rows were never re-embedded), and an unknown row is only a
miss, until it expires within CACHE_TTL_SECONDS."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("toolkit", "0002_erasure_subject")]

    operations = [
        migrations.AddField(
            model_name="cacheentry",
            name="embedder",
            field=models.CharField(blank=True, default="", max_length=64),
        ),
    ]
