"""First sight of an OIDC subject whose claims cannot be kept as they came: a
preferred_username that is another user's once normalised (NFKC), an email with a NUL,
a subject longer than its column. Each gave a 500, and the username case kept giving it
on every later request of that user."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model

from memories.models import ExternalIdentity
from memories.oidc import IDENTITY_MAX_CHARS

pytestmark = [pytest.mark.django_db(transaction=True)]


def test_a_username_taken_once_normalised_gets_a_name_of_its_own(oidc, api_client, alice):
    client = api_client(oidc.token(aud="memsite", azp="app", sub="kc-1", preferred_username="\uff41lice"))
    for _ in range(2):  # and again, once the user exists
        assert client.get("/v1/memory").status_code == 200
    user = ExternalIdentity.objects.get(subject="kc-1").user
    assert user != alice and user.username.startswith("oidc-")


def test_an_email_that_cannot_be_stored_is_left_out(oidc, api_client):
    client = api_client(oidc.token(aud="memsite", azp="app", sub="kc-2", preferred_username="eve", email="e\x00@x.org"))
    assert client.get("/v1/memory").status_code == 200
    assert get_user_model().objects.get(username="eve").email == ""


def test_a_subject_longer_than_its_column_is_refused_like_any_unusable_token(oidc, api_client):
    client = api_client(oidc.token(aud="memsite", azp="app", sub="k" * 300, preferred_username="longsub"))
    answer = client.get("/v1/memory")
    assert answer.status_code == 401 and answer.json()["error"]["code"] == "unauthenticated"
    assert not get_user_model().objects.filter(username="longsub").exists()
    assert ExternalIdentity._meta.get_field("subject").max_length == IDENTITY_MAX_CHARS
    assert ExternalIdentity._meta.get_field("issuer").max_length == IDENTITY_MAX_CHARS
