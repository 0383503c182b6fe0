"""Turn Django's DATABASES entry into the connection strings other clients need."""

from urllib.parse import quote


def database_conninfo(db: dict) -> str:
    """A libpq keyword string for the engine's own pool (mem0 talks psycopg directly)."""
    from psycopg.conninfo import make_conninfo

    parts = {
        "host": db.get("HOST"),
        "port": db.get("PORT"),
        "user": db.get("USER"),
        "password": db.get("PASSWORD"),
        "dbname": db.get("NAME"),
    }
    extra = {k: v for k, v in (db.get("OPTIONS") or {}).items() if k in ("sslmode", "sslrootcert")}
    return make_conninfo(**{k: str(v) for k, v in parts.items() if v}, **extra)


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
