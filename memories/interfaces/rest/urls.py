from django.urls import path
from drf_spectacular.views import SpectacularAPIView

from memories.interfaces.rest import views as api

urlpatterns = [
    path("memories", api.MemoryCollectionView.as_view(), name="api-memories"),
    path("memories/search", api.MemorySearchView.as_view(), name="api-memories-search"),
    path("memories/ingest", api.MemoryIngestView.as_view(), name="api-memories-ingest"),
    path("memories/export", api.MemoryExportView.as_view(), name="api-memories-export"),
    path("memories/import", api.MemoryImportView.as_view(), name="api-memories-import"),
    path("memories/clear", api.MemoryClearView.as_view(), name="api-memories-clear"),
    path("memories/<str:memory_id>", api.MemoryItemView.as_view(), name="api-memory"),
    path("schema/", SpectacularAPIView.as_view(authentication_classes=[], permission_classes=[]), name="api-schema"),
]
