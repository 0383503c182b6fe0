"""Turn Django's DATABASES entry into the connection strings other clients need."""

from urllib.parse import quote


def sqlalchemy_url(db: dict, *, scheme: str) -> str:
    user = quote(db.get("USER") or "", safe="")
    password = db.get("PASSWORD")
    auth = f"{user}:{quote(password, safe='')}" if password else user
    host = db.get("HOST") or ""
    name = quote(db.get("NAME") or "", safe="")
    if host.startswith("/"):
        return f"{scheme}://{auth}@/{name}?host={quote(host, safe='/')}"
    port = f":{db['PORT']}" if db.get("PORT") else ""
    return f"{scheme}://{auth}@{host}{port}/{name}"
