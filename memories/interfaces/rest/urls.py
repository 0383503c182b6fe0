from django.urls import path
from drf_spectacular.views import SpectacularAPIView

from memories.interfaces.rest import prefetch, seed001
from memories.interfaces.rest import views as api

urlpatterns = [
    path("memories", api.MemoryCollectionView.as_view(), name="api-memories"),
    path("memories/search", api.MemorySearchView.as_view(), name="api-memories-search"),
    path("memories/ingest", api.MemoryIngestView.as_view(), name="api-memories-ingest"),
    path("memories/clear", api.MemoryClearView.as_view(), name="api-memories-clear"),
    path("memories/forget", api.MemoryForgetView.as_view(), name="api-memories-forget"),
    path("memories/<str:memory_id>", api.MemoryItemView.as_view(), name="api-memory"),
    path("trash", api.TrashView.as_view(), name="api-trash"),
    path("trash/restore", api.TrashRestoreView.as_view(), name="api-trash-restore"),
    path("trash/purge", api.TrashPurgeView.as_view(), name="api-trash-purge"),
    # Seed 001's shape.
    path("memory", seed001.SeedMemoryCollectionView.as_view(), name="api-v1-memory"),
    path("memory/search", seed001.SeedMemorySearchView.as_view(), name="api-v1-memory-search"),
    path("memory/prefetch", prefetch.SeedMemoryPrefetchView.as_view(), name="api-v1-memory-prefetch"),  # issue 13
    path("memory/<str:memory_id>", seed001.SeedMemoryItemView.as_view(), name="api-v1-memory-item"),
    path("memory/<str:memory_id>/forget", seed001.SeedMemoryForgetView.as_view(), name="api-v1-memory-forget"),
    path("schema/", SpectacularAPIView.as_view(authentication_classes=[], permission_classes=[]), name="api-schema"),
]
