from django.contrib.auth import BACKEND_SESSION_KEY

OIDC_BACKEND = "memories.interfaces.web.oidc_login.MemsiteOIDCBackend"


def web(request) -> dict:
    """Whether signing out should also end the session at the OIDC provider."""
    session = getattr(request, "session", None)
    return {"oidc_logout": session is not None and bool(session) and session.get(BACKEND_SESSION_KEY) == OIDC_BACKEND}
