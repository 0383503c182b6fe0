from django.contrib.auth import views as auth_views
from django.urls import path

from memories.interfaces.web import login as web_login
from memories.interfaces.web import sessions as web_sessions
from memories.interfaces.web import toolkit_views
from memories.interfaces.web import views as web

urlpatterns = [
    path("", web.home, name="web-home"),
    path("accounts/login/", web_login.LoginView.as_view(redirect_authenticated_user=True), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("memories/", web.memory_index, name="web-memories"),
    path("memories/clear/", web.memory_clear, name="web-clear"),
    path("memories/forget/", web.memory_forget, name="web-forget"),
    path("trash/", web.trash, name="web-trash"),
    path("trash/restore/", web.trash_restore, name="web-trash-restore"),
    path("trash/purge/", web.trash_purge, name="web-trash-purge"),
    path("memories/<uuid:memory_id>/", web.memory_detail, name="web-memory"),
    path("memories/<uuid:memory_id>/pin/", web.memory_pin, name="web-memory-pin"),
    path("memories/<uuid:memory_id>/edit/", web.memory_edit, name="web-memory-edit"),
    path("memories/<uuid:memory_id>/fields/", web.memory_fields_edit, name="web-memory-fields"),
    path("memories/<uuid:memory_id>/delete/", web.memory_delete_view, name="web-memory-delete"),
    path("data/", web.data_page, name="web-data"),
    path("data/export/", web.data_export, name="web-data-export"),
    path(
        "data/export/decisions-and-cache/",
        toolkit_views.decisions_and_cache_export,
        name="web-data-export-decisions-and-cache",
    ),
    path("data/import/", web.data_import, name="web-data-import"),
    path("keys/", web.api_keys, name="web-keys"),
    path("keys/<str:key_id>/revoke/", web.api_key_revoke_view, name="web-key-revoke"),
    path("usage/", web.usage, name="web-usage"),
    # Issue 13: agent sessions.
    path("sessions/", web_sessions.sessions, name="web-sessions"),
    path("sessions/log/", web_sessions.session_log, name="web-session-log"),
    path("sessions/log/archives/", web_sessions.session_log_archives, name="web-session-log-archives"),
    path("data/export/session-logs/", web_sessions.session_logs_download, name="web-data-export-session-logs"),
    path("sessions/delete-events/", web_sessions.session_events_delete, name="web-session-events-delete"),
    # Issue 14: decisions and erasure.
    path("decisions/", toolkit_views.decisions, name="web-decisions"),
    path("decisions/delete/", toolkit_views.decision_delete, name="web-decision-delete"),
    path("cache/", toolkit_views.cache_entries, name="web-cache"),
    path("cache/delete/", toolkit_views.cache_entry_delete, name="web-cache-delete"),
    path("cache/clear/", toolkit_views.cache_entries_clear, name="web-cache-clear"),
    path("erase/", toolkit_views.erase_all, name="web-erase"),
    path("activity/", web.activity, name="web-activity"),
]
