from django.urls import path

from proxy import web

urlpatterns = [
    path("keys/<str:key_id>/chat/", web.key_chat_config, name="proxy-key-config"),
]
