from django.urls import path

from proxy import views

urlpatterns = [
    path("chat/completions", views.chat_completions, name="proxy-chat-completions"),
    path("admin/tokens", views.admin_tokens, name="proxy-admin-tokens"),
    path("admin/tokens/<str:key_id>", views.admin_token, name="proxy-admin-token"),
]
