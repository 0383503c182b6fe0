from django.urls import path

from oauth import views

urlpatterns = [
    path("consent/<str:request_key>/", views.consent, name="oauth-consent"),
    path("apps/", views.connected_apps, name="oauth-connected-apps"),
    path("apps/<int:grant_id>/revoke/", views.connected_app_revoke, name="oauth-connected-app-revoke"),
]
