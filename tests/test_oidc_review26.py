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


def test_a_username_that_normalises_past_its_column_gets_a_name_of_its_own(oidc, api_client):
    client = api_client(oidc.token(aud="memsite", azp="app", sub="kc-3", preferred_username="\ufdfa" * 10))
    assert client.get("/v1/memory").status_code == 200  # NFKC makes 180 characters of 10
    assert ExternalIdentity.objects.get(subject="kc-3").user.username.startswith("oidc-")


def test_two_subjects_taking_one_free_name_at_once_both_sign_in(oidc, monkeypatch):
    """Both passed the free-name check; the second failed the unique constraint and then
    looked up an identity that was never created."""
    from memories import oidc as oidc_module

    claims = {"preferred_username": "sam"}
    first = oidc_module.user_for_subject(issuer="https://idp", subject="kc-a", claims=claims)
    monkeypatch.setattr(oidc_module, "_username_for", lambda issuer, subject, claims: "sam")  # as if unchecked
    second = oidc_module.user_for_subject(issuer="https://idp", subject="kc-b", claims=claims)
    assert first.username == "sam" and second is not None and second.username.startswith("oidc-")
    assert ExternalIdentity.objects.get(subject="kc-b").user == second


def test_the_web_login_refuses_a_subject_it_cannot_keep(oidc, settings):
    from memories.interfaces.web.oidc_login import MemsiteOIDCBackend

    settings.OIDC_RP_CLIENT_ID, settings.OIDC_RP_CLIENT_SECRET = "web", "web-secret"
    assert list(MemsiteOIDCBackend().filter_users_by_claims({"sub": "k\x00"})) == []
