"""The one settings module. Everything variable comes from the environment.

See README.md ("Configuration") for every variable. Secrets have no default outside
local development (MEMSITE_ENV=local, the default for a checkout).
"""

import re
from pathlib import Path
from typing import Any

import dj_database_url
from celery.schedules import crontab

from core.choices import MEMORY_TOOL_OPERATIONS, Operation
from core.logs import logging_config
from memsite.dbconf import sqlalchemy_url
from memsite.embedded_pg import django_database_settings
from memsite.env import (
    ConfigError,
    env_bool,
    env_choice,
    env_float,
    env_int,
    env_list,
    env_map,
    env_path,
    env_rate,
    env_str,
)

BASE_DIR = Path(__file__).resolve().parent.parent

MEMSITE_ENV = env_choice("MEMSITE_ENV", "local", ("local", "test", "production"))
LOCAL_DEV = MEMSITE_ENV in ("local", "test")

DATA_DIR = env_path("MEMSITE_DATA_DIR", BASE_DIR / "var")

SECRET_KEY = env_str("DJANGO_SECRET_KEY")
if SECRET_KEY is None:
    if not LOCAL_DEV:
        raise ConfigError("DJANGO_SECRET_KEY must be set when MEMSITE_ENV=production")
    SECRET_KEY = "insecure-local-development-key-not-for-production"  # noqa: S105 - local only

DEBUG = env_bool("DJANGO_DEBUG", False)
HOST = env_str("HOST", "127.0.0.1")
PORT = env_int("PORT", 8000, minimum=1, maximum=65535)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.postgres",
    "django_celery_beat",
    "mozilla_django_oidc",
    "rest_framework",
    "drf_spectacular",
    "memsite",
    "memories",
    "billing",
    "audit",
    "proxy",
    "memories.toolkit",
    "oauth",
]

MIDDLEWARE = [
    # First: binds the request id every log line, audit row and X-Request-Id carries.
    "memsite.observability.RequestIdMiddleware",
    # Before anything asks for the host: a JSON surface answers a foreign one in JSON (421).
    "memsite.middleware.ForeignHostMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    # After sessions and auth (its error page is the signed-in layout), before any view:
    # invalid text in a page's path or parameters is a 4xx, never a DataError from Postgres.
    "memsite.middleware.RequestInputMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "memsite.urls"
ASGI_APPLICATION = "memsite.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "memories.interfaces.web.context_processors.web",
            ],
        },
    },
]

# --- Database -------------------------------------------------------------------
# Unset DATABASE_URL = the embedded server under DATA_DIR (started by the launcher,
# or on demand by manage.py). Any Postgres with the `vector` extension otherwise.
DATABASE_URL = env_str("DATABASE_URL")
EMBEDDED_DATABASE = DATABASE_URL is None
if DATABASE_URL is None:
    _default_db: dict[str, Any] = django_database_settings(DATA_DIR)
else:
    try:
        _default_db = dict(dj_database_url.parse(DATABASE_URL))
    except ValueError:  # ParseError, UnknownSchemeError: their text may quote the password
        raise ConfigError("DATABASE_URL is not a valid postgresql:// URL") from None
    if _default_db.get("ENGINE") != "django.db.backends.postgresql":
        raise ConfigError("DATABASE_URL is not a valid postgresql:// URL")
if _database_name := env_str("DATABASE_NAME"):
    # Lets a helper process (e.g. a test worker) share a server but use another database.
    _default_db["NAME"] = _database_name
# A psycopg pool per process (Django >= 5.1): ASGI runs requests on short-lived threads,
# where per-thread persistent connections would leak; a pool makes connecting ~free.
DATABASE_POOL_MAX_SIZE = env_int("DATABASE_POOL_MAX_SIZE", 16, minimum=0)
# CONN_HEALTH_CHECKS: with the pool, Django passes `check=ConnectionPool.check_connection`,
# which tests a pooled connection on checkout, so one broken by a database restart is
# replaced rather than failing a request (without the pool: a check per request). While the
# database is away a request waits up to DATABASE_POOL_TIMEOUT_S for a connection, then gets
# 503 backend_unavailable.
DATABASE_POOL_TIMEOUT_S = env_float("DATABASE_POOL_TIMEOUT_S", 5.0, minimum=0.1)
# psycopg_pool retries a failed connect about every second (memsite.apps) for this long, then
# gives up until a request needs a connection and starts a fresh attempt. Long enough to span
# a restart, so a pool reconnects within about a second of the database coming back.
DATABASE_POOL_RECONNECT_TIMEOUT_S = 60.0
if DATABASE_POOL_MAX_SIZE:
    _default_db.setdefault("OPTIONS", {})["pool"] = {
        "min_size": 1,
        "max_size": DATABASE_POOL_MAX_SIZE,
        "timeout": DATABASE_POOL_TIMEOUT_S,
        "reconnect_timeout": DATABASE_POOL_RECONNECT_TIMEOUT_S,
    }
    _default_db["CONN_MAX_AGE"] = 0
else:
    _default_db["CONN_MAX_AGE"] = env_int("DATABASE_CONN_MAX_AGE", 0, minimum=0)
_default_db["CONN_HEALTH_CHECKS"] = True
if _default_db.get("ENGINE") == "django.db.backends.postgresql":
    # The same backend, with a checkout check that polls the socket instead of a round trip.
    _default_db["ENGINE"] = "memsite.postgresql"
DATABASES = {"default": _default_db}
# The memory REST API's sync views run on this many threads per web process
# (memsite/threaded_django.py); more requests than that wait their turn in the process.
# Each can hold two pooled connections (a search's BM25 side runs on a second one).
REST_THREADS = env_int("REST_THREADS", 8, minimum=1)
# MCP tool calls and bearer checks run on their own threads: work hung on OAuth or the
# chat proxy (the event loop's default executor) cannot stall them.
MCP_THREADS = env_int("MCP_THREADS", 8, minimum=1)
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"


# --- Auth, i18n, static -----------------------------------------------------------
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "static/"
STATIC_ROOT = DATA_DIR / "static"

LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "web-memories"
LOGOUT_REDIRECT_URL = "login"
SESSION_COOKIE_SECURE = not LOCAL_DEV
CSRF_COOKIE_SECURE = not LOCAL_DEV
# HSTS: a browser that got the header over https uses only https for this host for that
# long. Django's SecurityMiddleware sends it on https responses only (`request.is_secure()`;
# behind a TLS proxy see SECURE_PROXY_SSL_HEADER). On in production (a year); 0 turns it
# off; off by default locally, where the site is plain http.
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 0 if LOCAL_DEV else 31_536_000, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", False)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", False)
if SECURE_HSTS_PRELOAD and not (SECURE_HSTS_INCLUDE_SUBDOMAINS and SECURE_HSTS_SECONDS >= 31_536_000):
    raise ConfigError("SECURE_HSTS_PRELOAD needs SECURE_HSTS_INCLUDE_SUBDOMAINS and SECURE_HSTS_SECONDS >= 31536000")
# Which requests came over https. uvicorn already takes the scheme from X-Forwarded-Proto
# (and the client's address from X-Forwarded-For) when the request comes from an address in
# FORWARDED_ALLOW_IPS (default: loopback, a proxy on the same host). Otherwise name the
# header the proxy sets to `https` (e.g. X-Forwarded-Proto): only if the proxy always sets
# it, replacing whatever the client sent, or a client could claim https.
_PROXY_SSL_HEADER = env_str("SECURE_PROXY_SSL_HEADER")
if _PROXY_SSL_HEADER is not None and not re.fullmatch(r"[A-Za-z0-9-]+", _PROXY_SSL_HEADER):
    raise ConfigError(
        f"SECURE_PROXY_SSL_HEADER must be a header name like X-Forwarded-Proto, got {_PROXY_SSL_HEADER!r}"
    )
SECURE_PROXY_SSL_HEADER = (
    ("HTTP_" + _PROXY_SSL_HEADER.upper().replace("-", "_"), "https") if _PROXY_SSL_HEADER else None
)

# --- Memory engine (mem0) ---------------------------------------------------------
EMBEDDER = env_choice("EMBEDDER", "local", ("local", "gemini"))
GOOGLE_API_KEY = env_str("GOOGLE_API_KEY")
GEMINI_EMBEDDING_MODEL = env_str("GEMINI_EMBEDDING_MODEL", "models/gemini-embedding-001")
GEMINI_EMBEDDING_DIMS = env_int("GEMINI_EMBEDDING_DIMS", 1536, minimum=1)
# The TOTAL time of one Gemini embedding request (connect to last byte), on the request
# path of every remember and search with EMBEDDER=gemini.
EMBEDDER_TIMEOUT_S = env_float("EMBEDDER_TIMEOUT_S", 10.0, minimum=0.1)
# Recent single-text vectors kept per process (digest keys; 2048 MiniLM vectors are 3 MiB,
# Gemini's 1536-d ones 12 MiB). 0 turns the cache off.
EMBEDDER_CACHE_SIZE = env_int("EMBEDDER_CACHE_SIZE", 2048, minimum=0)
# How long one of them is kept at most (from when it was embedded): the bound on how long a
# vector of an erased text stays in another process's memory. 0 turns the cache off too.
EMBEDDER_CACHE_TTL_S = env_float("EMBEDDER_CACHE_TTL_S", 900.0, minimum=0.0)
GEMINI_LLM_MODEL = env_str("GEMINI_LLM_MODEL", "gemini-2.5-flash")
if EMBEDDER == "gemini" and not GOOGLE_API_KEY:
    raise ConfigError("EMBEDDER=gemini needs GOOGLE_API_KEY")
EMBEDDING_DIMS = 384 if EMBEDDER == "local" else GEMINI_EMBEDDING_DIMS

LLM_BASE_URL = env_str("LLM_BASE_URL")
LLM_API_KEY = env_str("LLM_API_KEY")
LLM_MODEL = env_str("LLM_MODEL")
if LLM_BASE_URL and not LLM_MODEL:
    raise ConfigError("LLM_BASE_URL needs LLM_MODEL")
LLM_MAX_TOKENS = env_int("LLM_MAX_TOKENS", 8000, minimum=1)
# The engine's LLM (ingest, enrichment, the proxy's extraction): the TOTAL time of one
# request, connect to last byte, however slowly the server answers; a request may be
# retried LLM_MAX_RETRIES times (on a timeout, a connection error, 408/409/429/5xx), so a
# call waits at most (1 + LLM_MAX_RETRIES) x LLM_TIMEOUT_S plus the SDK's short backoff.
LLM_TIMEOUT_S = env_float("LLM_TIMEOUT_S", 30.0, minimum=0.1)
LLM_MAX_RETRIES = env_int("LLM_MAX_RETRIES", 1, minimum=0)

MEMORY_COLLECTION = env_str("MEMORY_COLLECTION", "memories")
MEMORY_HNSW = env_bool("MEMORY_HNSW", False)
MEM0_DIR = DATA_DIR / "mem0"

# Where clients reach us (behind a proxy); otherwise derived from each request.
PUBLIC_BASE_URL = (env_str("PUBLIC_BASE_URL") or "").rstrip("/") or None

# --- Memory operations --------------------------------------------------------------
# Recency decay for non-pinned search results: the score halves every N days.
SEARCH_DECAY_HALF_LIFE_DAYS = env_float("SEARCH_DECAY_HALF_LIFE_DAYS", 30.0, minimum=0.01)
SEARCH_DECAY_FLOOR = env_float("SEARCH_DECAY_FLOOR", 0.5, minimum=0.0)
# Candidates fetched per requested result, so decay can re-rank beyond the top k.
SEARCH_CANDIDATE_FACTOR = env_int("SEARCH_CANDIDATE_FACTOR", 3, minimum=1)
# Hybrid retrieval (memories/retrieval.py). SEARCH_FUSION=score: cosine similarity +
# SEARCH_COVERAGE_WEIGHT x the IDF-weighted share of the query's terms a memory contains.
# SEARCH_FUSION=rrf: each of the vector and BM25 rankings contributes
# weight / (SEARCH_RRF_K + rank). Either way each side looks SEARCH_CANDIDATES deep and a
# weight of 0 turns that side off.
SEARCH_FUSION = env_choice("SEARCH_FUSION", "score", ("score", "rrf"))
SEARCH_COVERAGE_WEIGHT = env_float("SEARCH_COVERAGE_WEIGHT", 1.0, minimum=0.0)
# Coverage counts only as far as the memory's meaning is related to the query: none at or
# below SEARCH_COVERAGE_UNRELATED_COSINE, in full from SEARCH_COVERAGE_RELATED_COSINE up.
# A memory sharing a word but not the meaning then gains nothing from the word. Every gate
# from (0-0.15) to (0.15-0.3) gives the same recall (paraphrase set 0.95 -> 0.963, LoCoMo
# unchanged, eval/fusion_lab.py); these are the middle of that range.
SEARCH_COVERAGE_UNRELATED_COSINE = env_float("SEARCH_COVERAGE_UNRELATED_COSINE", 0.05, minimum=-1.0)
SEARCH_COVERAGE_RELATED_COSINE = env_float(
    "SEARCH_COVERAGE_RELATED_COSINE", 0.25, minimum=SEARCH_COVERAGE_UNRELATED_COSINE
)
SEARCH_VECTOR_WEIGHT = env_float("SEARCH_VECTOR_WEIGHT", 1.0, minimum=0.0)
SEARCH_LEXICAL_WEIGHT = env_float("SEARCH_LEXICAL_WEIGHT", 2.0, minimum=0.0)
SEARCH_RRF_K = env_int("SEARCH_RRF_K", 10, minimum=1)
# The vector side's depth: 50 and 100 give the same recall@5 on both eval sets (20 too, so
# 50 leaves a margin), and an HNSW scan that needs 50 of a large user's rows iterates less
# (at 10k memories: the vector statement's p99 8.2 -> 6.0 ms; docs/benchmarks.md).
SEARCH_CANDIDATES = env_int("SEARCH_CANDIDATES", 50, minimum=1)
# Score fusion's BM25 side looks this deep (RRF's looks SEARCH_CANDIDATES deep). A fused
# score is cosine + coverage, so BM25 only nominates candidates: its top 50 and top 100 give
# the same recall on both eval sets (LoCoMo 0.6248 against 0.6242, paraphrase 0.9542; 30:
# LoCoMo 0.6202), and for a large user the pruned BM25 proves a top 50 in one visit of the
# rows holding every query term far more often than a top 100 (docs/benchmarks.md).
SEARCH_LEXICAL_CANDIDATES = env_int("SEARCH_LEXICAL_CANDIDATES", 50, minimum=1)
# Neighbour context (score fusion, unfiltered searches): each of the best
# SEARCH_NEIGHBOUR_CANDIDATES gains SEARCH_NEIGHBOUR_WEIGHT x the better score of the
# memories stored just before and after it (same agent and session, at most
# SEARCH_NEIGHBOUR_WINDOW_S apart). A weight of 0 turns it off.
SEARCH_NEIGHBOUR_WEIGHT = env_float("SEARCH_NEIGHBOUR_WEIGHT", 0.3, minimum=0.0)
SEARCH_NEIGHBOUR_CANDIDATES = env_int("SEARCH_NEIGHBOUR_CANDIDATES", 30, minimum=1)
SEARCH_NEIGHBOUR_WINDOW_S = env_int("SEARCH_NEIGHBOUR_WINDOW_S", 1800, minimum=0)
# Score fusion runs the BM25 side on a second pooled connection while the request's thread
# embeds the query and runs the vector statement (never inside a transaction, whose
# uncommitted rows another connection cannot see). Off: one after the other.
SEARCH_LEXICAL_CONCURRENT = env_bool("SEARCH_LEXICAL_CONCURRENT", True)
# Vector search plan per query, by the user's row count (cached SEARCH_PLAN_CACHE_S): an exact
# scan of the user's rows below SEARCH_INDEX_MIN_ROWS, the HNSW index with pgvector 0.8's
# iterative scans (a filtered search keeps scanning instead of losing rows) from there on,
# when the server has them. 0 always scans exactly. SEARCH_HNSW_EF_SEARCH: the HNSW candidate
# list (raised to the number of candidates asked for); more is slower and closer to exact.
SEARCH_INDEX_MIN_ROWS = env_int("SEARCH_INDEX_MIN_ROWS", 5000, minimum=0)
SEARCH_HNSW_EF_SEARCH = env_int("SEARCH_HNSW_EF_SEARCH", 200, minimum=1)
SEARCH_PLAN_CACHE_S = env_float("SEARCH_PLAN_CACHE_S", 60.0, minimum=0.0)
MEMORY_LOCK_TIMEOUT_S = env_float("MEMORY_LOCK_TIMEOUT_S", 10.0, minimum=0.1)
# An ingest intent still open after this long belongs to a call that crashed (its LLM
# call is long over): the reconciler completes or undoes it.
INGEST_INTENT_LEASE_S = env_float("INGEST_INTENT_LEASE_S", 600.0, minimum=0.0)
# Closed ingest intents are deleted this many days after they closed (`memories.ingest_intents_prune`,
# daily): nothing reads one after its call and the chat proxy's sweep are done with it
# (minutes to an hour); the audit row and usage event keep the record. Start-up check E003.
INGEST_INTENT_RETENTION_DAYS = env_int("INGEST_INTENT_RETENTION_DAYS", 7, minimum=1)

# Per user and operation: "N/second|minute|hour|day"; 0 disables a limit.
MEMORY_OPERATIONS = tuple(op.value for op in MEMORY_TOOL_OPERATIONS)
_RATE_DEFAULTS = {
    Operation.SEARCH_MEMORY: "120/minute",
    Operation.REMEMBER: "60/minute",
    Operation.INGEST: "20/minute",
    Operation.UPDATE_MEMORY: "60/minute",
    Operation.DELETE_MEMORY: "60/minute",
    Operation.RESTORE_MEMORY: "60/minute",
    Operation.PURGE_MEMORY: "60/minute",
    Operation.LIST_MEMORY: "120/minute",
    Operation.CLEAR_ALL_MEMORY: "5/hour",
    Operation.EXPORT_MEMORIES: "30/hour",
    # The web UI's other downloads ("Your data"): a session log export can be large.
    Operation.EXPORT_DECISIONS_AND_CACHE: "30/hour",
    Operation.EXPORT_SESSION_LOGS: "30/hour",
    Operation.IMPORT_MEMORIES: "20/hour",
    Operation.CHAT_COMPLETION: "120/minute",
}
# Export/import of one user's memories: the largest file and the most memories one import takes.
IMPORT_MAX_BYTES = env_int("IMPORT_MAX_BYTES", 20 * 1024 * 1024, minimum=1)
# Every request body, before any app reads it (memsite/body_limit.py): Django spools a body
# to disk whole before authentication runs. Well above the largest one a surface takes (an
# import file), so a file somewhat over that still reaches the page that says what to do.
REQUEST_BODY_MAX_BYTES = env_int("REQUEST_BODY_MAX_BYTES", 4 * IMPORT_MAX_BYTES, minimum=1024)
IMPORT_MAX_MEMORIES = env_int("IMPORT_MAX_MEMORIES", 20_000, minimum=1)
RATE_LIMITS = {op.value: env_rate(f"RATE_LIMIT_{op.value.upper()}", default) for op, default in _RATE_DEFAULTS.items()}

# Deleted memories wait this many days in the user's trash (restorable); 0 deletes at once.
TRASH_RETENTION_DAYS = env_int("TRASH_RETENTION_DAYS", 30, minimum=0)
# The recall counters fold search audit rows older than this (so no row still being
# committed is skipped by the watermark).
RECALLS_SETTLE_SECONDS = env_int("RECALLS_SETTLE_SECONDS", 60, minimum=0)

# --- Authentication -------------------------------------------------------------------
# Agents send `Authorization: Bearer <token>`: a per-user API key (msk_...) or, when
# OIDC_ISSUER is set, an OIDC access token (JWT) from that provider.
OIDC_ISSUER = env_str("OIDC_ISSUER")
OIDC_AUDIENCE = env_str("OIDC_AUDIENCE")
OIDC_JWKS_URL = env_str("OIDC_JWKS_URL")
OIDC_ALGORITHMS = env_list("OIDC_ALGORITHMS", ["RS256", "ES256"])
if OIDC_ISSUER and not OIDC_AUDIENCE:
    raise ConfigError("OIDC_ISSUER needs OIDC_AUDIENCE (the audience our access tokens carry)")

# Web UI login through the same provider (authorization code + PKCE): set the client.
OIDC_RP_CLIENT_ID = env_str("OIDC_RP_CLIENT_ID")
OIDC_RP_CLIENT_SECRET = env_str("OIDC_RP_CLIENT_SECRET")
OIDC_WEB_LOGIN = bool(OIDC_RP_CLIENT_ID)
if OIDC_WEB_LOGIN and not OIDC_ISSUER:
    raise ConfigError("OIDC_RP_CLIENT_ID needs OIDC_ISSUER")
OIDC_RP_SIGN_ALGO = env_str("OIDC_RP_SIGN_ALGO", "RS256")
OIDC_RP_SCOPES = env_str("OIDC_RP_SCOPES", "openid email profile")
OIDC_USE_PKCE = True
OIDC_OP_AUTHORIZATION_ENDPOINT = env_str("OIDC_OP_AUTHORIZATION_ENDPOINT")
OIDC_OP_TOKEN_ENDPOINT = env_str("OIDC_OP_TOKEN_ENDPOINT")
OIDC_OP_USER_ENDPOINT = env_str("OIDC_OP_USER_ENDPOINT")
OIDC_OP_JWKS_ENDPOINT = env_str("OIDC_OP_JWKS_ENDPOINT")
OIDC_OP_LOGOUT_ENDPOINT = env_str("OIDC_OP_LOGOUT_ENDPOINT")
OIDC_AUTHENTICATE_CLASS = "memories.interfaces.web.oidc_login.LoginStart"
OIDC_CALLBACK_CLASS = "memories.interfaces.web.oidc_login.LoginCallback"
OIDC_OP_LOGOUT_URL_METHOD = "memories.interfaces.web.oidc_login.provider_logout_url"
AUTHENTICATION_BACKENDS = ["django.contrib.auth.backends.ModelBackend"]
if OIDC_WEB_LOGIN:
    AUTHENTICATION_BACKENDS.append("memories.interfaces.web.oidc_login.MemsiteOIDCBackend")
# Sign-in with a password (the web UI's and the admin's forms): failed attempts per username
# (existing or not) and per client address (an IPv6 client's /64) over a sliding window.
# Past either limit the form answers 429 without checking the password until enough of
# them age out of the window. A success resets nothing.
LOGIN_FAILURE_WINDOW_S = env_int("LOGIN_FAILURE_WINDOW_S", 900, minimum=1, maximum=86400)
LOGIN_FAILURES_PER_USERNAME = env_int("LOGIN_FAILURES_PER_USERNAME", 10, minimum=1, maximum=10_000)
LOGIN_FAILURES_PER_ADDRESS = env_int("LOGIN_FAILURES_PER_ADDRESS", 50, minimum=1, maximum=100_000)

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["memories.interfaces.rest.auth.BearerTokenAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["memories.interfaces.rest.parsers.SafeJSONParser"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "memories.interfaces.rest.errors.exception_handler",
    "UNAUTHENTICATED_USER": None,
    # No `?format=` renderer override: it answered an unknown value 404 before
    # authentication. Each view reads its own parameters (the export's `format` among them).
    "URL_FORMAT_OVERRIDE": None,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "memsite memory API",
    "DESCRIPTION": "The seven memory operations of the MCP endpoint, over REST.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "OAS_VERSION": "3.1.0",
}

# --- Billing ---------------------------------------------------------------------------
# Every successful call leaves one usage event in an outbox; a worker POSTs them here.
PAYMENT_GATEWAY_URL = env_str("PAYMENT_GATEWAY_URL")
USAGE_INGEST_API_KEY = env_str("USAGE_INGEST_API_KEY")
if PAYMENT_GATEWAY_URL and not USAGE_INGEST_API_KEY and not LOCAL_DEV:
    raise ConfigError("PAYMENT_GATEWAY_URL needs USAGE_INGEST_API_KEY")
USAGE_BATCH_SIZE = env_int("USAGE_BATCH_SIZE", 100, minimum=1)
# The TOTAL time of one POST to the gateway (connect to answer), however slowly it answers.
USAGE_DELIVERY_TIMEOUT_S = env_float("USAGE_DELIVERY_TIMEOUT_S", 10.0, minimum=0.1)
USAGE_RETRY_BASE_S = env_float("USAGE_RETRY_BASE_S", 5.0, minimum=0.0)
USAGE_RETRY_MAX_S = env_float("USAGE_RETRY_MAX_S", 600.0, minimum=0.0)
USAGE_CLAIM_LEASE_S = env_float("USAGE_CLAIM_LEASE_S", 120.0, minimum=1.0)
# Calls within this window (per process) share one delivery task; 0 = one per call.
USAGE_ENQUEUE_WINDOW_S = env_float("USAGE_ENQUEUE_WINDOW_S", 1.0, minimum=0.0)

# --- Audit -------------------------------------------------------------------------------
# Keep memory text out of audit rows (a sha256 and the length instead).
AUDIT_REDACT_CONTENT = env_bool("AUDIT_REDACT_CONTENT", False)
AUDIT_EXPORT_BATCH_SIZE = env_int("AUDIT_EXPORT_BATCH_SIZE", 50_000, minimum=1)
AUDIT_EXPORT_LAG_S = env_int("AUDIT_EXPORT_LAG_S", 300, minimum=0)
AUDIT_RETENTION_DAYS = env_int("AUDIT_RETENTION_DAYS", 0, minimum=0)  # 0 = keep forever

# Exported audit batches go to S3-compatible storage under object lock (Cloudflare R2 in
# production); without a bucket, to files under the data dir (no lock).
AUDIT_S3_BUCKET = env_str("AUDIT_S3_BUCKET")
_AUDIT_LOCK_MODE = env_choice("AUDIT_OBJECT_LOCK_MODE", "COMPLIANCE", ("COMPLIANCE", "GOVERNANCE", "none"))
if AUDIT_S3_BUCKET:
    _audit_storage = {
        "BACKEND": "audit.storage.LockedS3Storage",
        "OPTIONS": {
            "bucket_name": AUDIT_S3_BUCKET,
            "endpoint_url": env_str("AUDIT_S3_ENDPOINT_URL"),
            "access_key": env_str("AUDIT_S3_ACCESS_KEY_ID"),
            "secret_key": env_str("AUDIT_S3_SECRET_ACCESS_KEY"),
            "region_name": env_str("AUDIT_S3_REGION", "auto"),
            "location": env_str("AUDIT_S3_PREFIX", "audit"),
            "file_overwrite": False,
            "addressing_style": env_choice("AUDIT_S3_ADDRESSING_STYLE", "path", ("path", "virtual", "auto")),
            "object_lock_mode": None if _AUDIT_LOCK_MODE == "none" else _AUDIT_LOCK_MODE,
            "object_lock_days": env_int("AUDIT_OBJECT_LOCK_DAYS", 2555, minimum=1),
        },
    }
else:
    _audit_storage = {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": DATA_DIR / "audit-export"},
    }
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": DATA_DIR / "media"}},
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    "audit": _audit_storage,
}

# --- Backups (embedded database) ----------------------------------------------------------
# Continuous WAL archiving + scheduled base backups, restore to a point in time (memsite/backup.py).
# With DATABASE_URL, back the external server up with its own PITR (README, "Backups").
BACKUP_ENABLED = env_bool("BACKUP_ENABLED", True)
BACKUP_DIR = env_path("BACKUP_DIR", DATA_DIR / "backups")
# A WAL segment is archived at least this often when there were writes: the RPO bound.
BACKUP_ARCHIVE_TIMEOUT_S = env_int("BACKUP_ARCHIVE_TIMEOUT_S", 60, minimum=1)
BACKUP_BASE_INTERVAL_H = env_float("BACKUP_BASE_INTERVAL_H", 24.0, minimum=0.01)
BACKUP_KEEP = env_int("BACKUP_KEEP", 7, minimum=1)  # base backups kept in a directory target
# An S3-compatible bucket (R2, S3, MinIO) with object lock instead of BACKUP_DIR.
BACKUP_S3_BUCKET = env_str("BACKUP_S3_BUCKET")
BACKUP_S3_ENDPOINT_URL = env_str("BACKUP_S3_ENDPOINT_URL")
BACKUP_S3_ACCESS_KEY_ID = env_str("BACKUP_S3_ACCESS_KEY_ID")
BACKUP_S3_SECRET_ACCESS_KEY = env_str("BACKUP_S3_SECRET_ACCESS_KEY")
BACKUP_S3_REGION = env_str("BACKUP_S3_REGION", "auto")
BACKUP_S3_PREFIX = env_str("BACKUP_S3_PREFIX", "postgres")
BACKUP_S3_ADDRESSING_STYLE = env_choice("BACKUP_S3_ADDRESSING_STYLE", "path", ("path", "virtual", "auto"))
_BACKUP_LOCK_MODE = env_choice("BACKUP_OBJECT_LOCK_MODE", "COMPLIANCE", ("COMPLIANCE", "GOVERNANCE", "none"))
BACKUP_OBJECT_LOCK_MODE = None if _BACKUP_LOCK_MODE == "none" else _BACKUP_LOCK_MODE
BACKUP_OBJECT_LOCK_DAYS = env_int("BACKUP_OBJECT_LOCK_DAYS", 35, minimum=1)

# --- Celery -----------------------------------------------------------------------
# Default broker: kombu's SQLAlchemy transport on the same Postgres (no Redis needed).
CELERY_BROKER_URL = env_str("CELERY_BROKER_URL") or sqlalchemy_url(_default_db, scheme="sqla+postgresql+psycopg")
if CELERY_BROKER_URL.startswith("sqla+"):
    # Reaches SQLAlchemy's create_engine: test pooled connections before use, so the broker
    # survives a database restart (kombu then reconnects on OperationalError).
    CELERY_BROKER_TRANSPORT_OPTIONS = {"pool_pre_ping": True}
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_IGNORE_RESULT = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BROKER_POLL_INTERVAL = env_float("CELERY_BROKER_POLL_INTERVAL", 0.5, minimum=0.05)
CELERY_TASK_ALWAYS_EAGER = False
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
CELERY_TIMEZONE = TIME_ZONE
CELERY_BEAT_SCHEDULE = {
    "worker-heartbeat": {"task": "memsite.worker_heartbeat", "schedule": 60.0},
    "broker-cleanup": {"task": "memsite.broker_cleanup", "schedule": 600.0},
    "rate-windows-prune": {"task": "memories.rate_windows_prune", "schedule": 3600.0},
    "memories-purge-due": {"task": "memories.purge_due", "schedule": 3600.0},
    "memories-recalls-fold": {"task": "memories.recalls_fold", "schedule": 60.0},
    "ingest-intents-reconcile": {"task": "memories.ingest_intents_reconcile", "schedule": 60.0},
    "ingest-intents-prune": {"task": "memories.ingest_intents_prune", "schedule": crontab(hour=5, minute=29)},
    "auth-failures-prune": {"task": "audit.auth_failures_prune", "schedule": 3600.0},
    "usage-delivery-sweep": {"task": "billing.deliver_usage_events", "schedule": 60.0},
    "audit-export-nightly": {"task": "audit.export", "schedule": crontab(hour=2, minute=17)},
    "audit-retention-daily": {"task": "audit.retention_purge", "schedule": crontab(hour=4, minute=41)},
    # Takes a base backup when the newest is older than BACKUP_BASE_INTERVAL_H.
    "backup-base-if-due": {"task": "memsite.backup_base_if_due", "schedule": 900.0},
    # Erasure ledger records still pending (each erasure enqueues its own write on commit).
    "erasure-ledger-sweep": {"task": "memsite.erasure_ledger_sweep", "schedule": 300.0},
}
BROKER_MESSAGE_RETENTION_S = env_int("BROKER_MESSAGE_RETENTION_S", 3600, minimum=0)

# --- Logging ----------------------------------------------------------------------
# One request id on every line of a call (core/logs.py): text as in seed 004
# (`[time] [level] [rid=...] [logger] message`) or one JSON object per line.
LOG_LEVEL = env_choice("LOG_LEVEL", "INFO", ("DEBUG", "INFO", "WARNING", "ERROR"))
LOG_FORMAT = env_choice("LOG_FORMAT", "text", ("text", "json"))
LOGGING = logging_config(log_format=LOG_FORMAT, level=LOG_LEVEL)
# Database error text can quote stored data (memsite/logfilters.py): withheld on every handler.
LOGGING["filters"]["redact_db_errors"] = {"()": "memsite.logfilters.RedactDatabaseErrors"}
for _handler in LOGGING["handlers"].values():
    _handler["filters"].insert(1, "redact_db_errors")  # after content_safe
# Celery workers and beat use this LOGGING too (memsite/celery.py), not their own.
CELERY_WORKER_HIJACK_ROOT_LOGGER = False

# --- Metrics ------------------------------------------------------------------------
# /metrics: with METRICS_TOKEN set, scrapers send `Authorization: Bearer <token>`;
# unset, only loopback clients may scrape (behind a proxy on the same host, set it).
# Samples of every process are summed through PROMETHEUS_MULTIPROC_DIR (the launcher
# sets it to DATA_DIR/metrics and empties it at start).
METRICS_TOKEN = env_str("METRICS_TOKEN")

# --- Agent turn lifecycle (issue 13, seed 002 §9) ------------------------------------------
# The one switch: serve the memory-lifecycle toolset at /engines/memory-lifecycle/mcp.
MCP_MEMORY_ENABLED = env_bool("MCP_MEMORY_ENABLED", True)
MCP_MEMORY_RECENT_CONTEXT_ITEMS = env_int("MCP_MEMORY_RECENT_CONTEXT_ITEMS", 30, minimum=0)
MCP_MEMORY_RECALL_FACTS_LIMIT = env_int("MCP_MEMORY_RECALL_FACTS_LIMIT", 20, minimum=0)
# Seed 002's storage-search chunk count; here: how many notes prefetch returns by default.
MCP_MEMORY_SEARCH_LIMIT = env_int("MCP_MEMORY_SEARCH_LIMIT", 5, minimum=1)
MCP_MEMORY_COMPACT_THRESHOLD = env_float("MCP_MEMORY_COMPACT_THRESHOLD", 0.8, minimum=0.05)
MCP_MEMORY_L1_RETENTION_DAYS = env_int("MCP_MEMORY_L1_RETENTION_DAYS", 1, minimum=1)
MCP_MEMORY_L2_RETENTION_DAYS = env_int("MCP_MEMORY_L2_RETENTION_DAYS", 7, minimum=1)
MCP_MEMORY_COMPACTION_MIN_AGE_HOURS = env_int("MCP_MEMORY_COMPACTION_MIN_AGE_HOURS", 24, minimum=0)
MCP_MEMORY_SUMMARY_REFRESH_INTERVAL_MINUTES = env_int("MCP_MEMORY_SUMMARY_REFRESH_INTERVAL_MINUTES", 60, minimum=0)
MCP_MEMORY_MAX_PROCESSED_TURNS = env_int("MCP_MEMORY_MAX_PROCESSED_TURNS", 1024, minimum=1)
# "heuristic" is seed 002's name for LLM-assisted extraction; off: rule-based, no LLM.
MCP_MEMORY_HEURISTIC_ENABLED = env_bool("MCP_MEMORY_HEURISTIC_ENABLED", False)
MCP_MEMORY_HEURISTIC_MODEL = env_str("MCP_MEMORY_HEURISTIC_MODEL", "openai/gpt-oss-120b")
# An absolute OpenAI-compatible base URL (…/v1); empty: LLM_BASE_URL. Chat completions are used.
MCP_MEMORY_HEURISTIC_BASE_URL = env_str("MCP_MEMORY_HEURISTIC_BASE_URL", "")
MCP_MEMORY_HEURISTIC_API_KEY = env_str("MCP_MEMORY_HEURISTIC_API_KEY", "")
# The TOTAL time of one extraction request (connect to last byte), not a per-read timeout.
MCP_MEMORY_HEURISTIC_TIMEOUT_MS = env_int("MCP_MEMORY_HEURISTIC_TIMEOUT_MS", 12000, minimum=100)
MCP_MEMORY_HEURISTIC_MAX_OUTPUT_TOKENS = env_int("MCP_MEMORY_HEURISTIC_MAX_OUTPUT_TOKENS", 800, minimum=1)
if MCP_MEMORY_HEURISTIC_BASE_URL and "://" not in MCP_MEMORY_HEURISTIC_BASE_URL:
    raise ConfigError("MCP_MEMORY_HEURISTIC_BASE_URL must be an absolute URL (https://host/...)")
# Payload limits per tool call (seed 002 §8), each refused with payload_too_large.
MCP_MEMORY_MAX_REQUEST_BYTES = env_int("MCP_MEMORY_MAX_REQUEST_BYTES", 200_000, minimum=1024)
MCP_MEMORY_MAX_ITEMS = env_int("MCP_MEMORY_MAX_ITEMS", 100, minimum=1)
MCP_MEMORY_MAX_PART_CHARS = env_int("MCP_MEMORY_MAX_PART_CHARS", 32_000, minimum=100)
# A `processing` turn younger than this is busy (resource_busy); older, a retry takes it over.
MCP_MEMORY_TURN_LEASE_S = env_float("MCP_MEMORY_TURN_LEASE_S", 120.0, minimum=0.0)
# How long memory_run_turn keeps a turn's current input for the after_turn that commits it.
MCP_MEMORY_RUN_TURN_TOKEN_TTL_HOURS = env_int("MCP_MEMORY_RUN_TURN_TOKEN_TTL_HOURS", 24, minimum=1)
MCP_MEMORY_SESSION_LOCK_TIMEOUT_S = env_float("MCP_MEMORY_SESSION_LOCK_TIMEOUT_S", 5.0, minimum=0.05)
RATE_LIMITS.update(
    {
        op.value: env_rate(f"RATE_LIMIT_{op.value.upper()}", default)
        for op, default in {
            Operation.MEMORY_BEFORE_TURN: "120/minute",
            # before_turn plus a token, counted and billed under its own name (same default).
            Operation.MEMORY_RUN_TURN: "120/minute",
            Operation.MEMORY_AFTER_TURN: "120/minute",
            Operation.MEMORY_RUN_MAINTENANCE: "30/minute",
            Operation.MEMORY_LIST_DIR_WITH_ABSTRACT: "60/minute",
            Operation.MEMORY_PREFETCH: "120/minute",
        }.items()
    }
)
CELERY_BEAT_SCHEDULE["memories-turns-maintenance-nightly"] = {
    "task": "memories.turns_maintenance_nightly",
    "schedule": crontab(hour=3, minute=23),
}
# --- Chat proxy (issue 15, seed 004) ------------------------------------------------
# Keys without their own configuration (admin API /v1/admin/tokens, or the API-key page)
# forward to this OpenAI-compatible upstream; unset: such keys get 401 on the proxy.
CHAT_UPSTREAM_BASE_URL = env_str("CHAT_UPSTREAM_BASE_URL", "")
CHAT_UPSTREAM_API_KEY = env_str("CHAT_UPSTREAM_API_KEY", "")
# Fernet key for upstream API keys at rest (`Fernet.generate_key()`); derived from
# SECRET_KEY when unset (set it in production so a SECRET_KEY rotation keeps them).
PROXY_ENCRYPTION_KEY = env_str("PROXY_ENCRYPTION_KEY", "")
PROXY_MEMORY_TEMPLATE_PATH = env_path("PROXY_MEMORY_TEMPLATE_PATH", BASE_DIR / "proxy" / "memory_template.md")
PROXY_MEMORY_SEARCH_TIMEOUT_S = env_float("PROXY_MEMORY_SEARCH_TIMEOUT_S", 30.0, minimum=0.01)
PROXY_MEMORY_STORE_TIMEOUT_S = env_float("PROXY_MEMORY_STORE_TIMEOUT_S", 120.0, minimum=0.1)
# The TOTAL deadline for the upstream's headers and, read whole, its answer; streamed, the
# longest silence between two whole events.
PROXY_UPSTREAM_TIMEOUT_S = env_float("PROXY_UPSTREAM_TIMEOUT_S", 120.0, minimum=0.1)
# A streamed answer is cut after this long in all (error event `upstream_timeout`, not billed).
PROXY_STREAM_MAX_S = env_float("PROXY_STREAM_MAX_S", 600.0, minimum=1.0)
# The most an upstream's answer may be, whole or streamed in all (502
# `upstream_answer_too_large` past it, not billed); one SSE event is capped at 1 MiB.
PROXY_MAX_ANSWER_BYTES = env_int("PROXY_MAX_ANSWER_BYTES", 16 * 1024 * 1024, minimum=1024)
# The chat proxy's own threads for its blocking steps (auth, memory search, recording).
PROXY_THREADS = env_int("PROXY_THREADS", 8, minimum=1)
PROXY_UPSTREAM_CONNECT_TIMEOUT_S = env_float("PROXY_UPSTREAM_CONNECT_TIMEOUT_S", 10.0, minimum=0.1)
# A key's own upstream (set by its owner) connects to public addresses only; this also
# admits loopback (tests, a local model server in development). The deployment default
# upstream (CHAT_UPSTREAM_BASE_URL) is the operator's and never restricted.
PROXY_KEY_UPSTREAM_ALLOW_LOOPBACK = env_bool("PROXY_KEY_UPSTREAM_ALLOW_LOOPBACK", False)
# Session messages compared for duplicates before a turn is stored (seed 004: 200).
PROXY_DEDUPE_WINDOW = env_int("PROXY_DEDUPE_WINDOW", 200, minimum=0)
CELERY_BEAT_SCHEDULE["proxy-turns-sweep"] = {"task": "proxy.turns_sweep", "schedule": 60.0}
# A chat turn whose extraction failed for a passing reason (the embedder, database or LLM
# down, a rate limit, a lock) is retried after BASE_S, doubling up to MAX_S (+-20 %), for
# RETRY_FOR_S from its first failure; then it is given up (an error log line, the
# `memsite_proxy_turns_failed` gauge) and kept for staff to re-queue.
PROXY_EXTRACTION_RETRY_BASE_S = env_float("PROXY_EXTRACTION_RETRY_BASE_S", 60.0, minimum=0.0)
PROXY_EXTRACTION_RETRY_MAX_S = env_float("PROXY_EXTRACTION_RETRY_MAX_S", 3600.0, minimum=0.0)
PROXY_EXTRACTION_RETRY_FOR_S = env_float("PROXY_EXTRACTION_RETRY_FOR_S", 86400.0, minimum=0.0)
# Closed chat turns are deleted after this many days (a given-up turn's messages with it).
PROXY_TURN_RETENTION_DAYS = env_int("PROXY_TURN_RETENTION_DAYS", 30, minimum=1)
CELERY_BEAT_SCHEDULE["proxy-turns-prune"] = {"task": "proxy.turns_prune", "schedule": crontab(hour=5, minute=7)}
# --- Seed 003's toolkit (issue 14: /engines/memory-toolkit/mcp) -------------------------------
# store_memory: one short-term memory per message, expiring after STM_TTL_HOURS.
STM_TTL_HOURS = env_float("STM_TTL_HOURS", 24.0, minimum=0.001)
# recall_memory / hybrid_search return at most this many results.
MAX_RESULTS_PER_QUERY = env_int("MAX_RESULTS_PER_QUERY", 50, minimum=1)
# recall_memory: score = a*recency + b*importance + c*relevance (recency halves every
# RECALL_RECENCY_HALF_LIFE_HOURS; relevance is the hybrid retrieval's score, scaled to [0, 1]).
RECALL_WEIGHT_RECENCY = env_float("RECALL_WEIGHT_RECENCY", 0.2, minimum=0.0)
RECALL_WEIGHT_IMPORTANCE = env_float("RECALL_WEIGHT_IMPORTANCE", 0.2, minimum=0.0)
RECALL_WEIGHT_RELEVANCE = env_float("RECALL_WEIGHT_RELEVANCE", 0.6, minimum=0.0)
RECALL_RECENCY_HALF_LIFE_HOURS = env_float("RECALL_RECENCY_HALF_LIFE_HOURS", 72.0, minimum=0.01)
# hybrid_search: weighted reciprocal rank fusion of the vector and full-text rankings.
RRF_VECTOR_WEIGHT = env_float("RRF_VECTOR_WEIGHT", 1.0, minimum=0.0)
RRF_TEXT_WEIGHT = env_float("RRF_TEXT_WEIGHT", 1.0, minimum=0.0)
RRF_K = env_int("RRF_K", 60, minimum=1)
# The semantic cache (check_cache / store_cache).
CACHE_SIMILARITY_THRESHOLD = env_float("CACHE_SIMILARITY_THRESHOLD", 0.95, minimum=0.0)
CACHE_TTL_SECONDS = env_int("CACHE_TTL_SECONDS", 3600, minimum=1)
# At most this many cached entries per user, expired ones not purged yet included: a store
# beyond it evicts the user's other entries that expire first (never the one it stores). store_cache's rate limit alone
# bounded a cache (off or raised, it grew without end), and check_cache and cache_invalidate
# read every entry of the user. Above what the default limit lets an hour's TTL hold
# (120/minute for 60 minutes, plus the 10 minutes between purges: 8,400).
CACHE_MAX_ENTRIES_PER_USER = env_int("CACHE_MAX_ENTRIES_PER_USER", 10_000, minimum=1)
# At most this many decisions per user: store_decision refuses a new key beyond it
# (payload_too_large; an update of a key the user has is always taken). Only its rate
# limit bounded them, and the "Your data" export holds all of them at once.
DECISION_MAX_PER_USER = env_int("DECISION_MAX_PER_USER", 10_000, minimum=1)
# search_web: off unless a provider key is set. Results are never stored as memories.
WEB_SEARCH_PROVIDER = env_choice("WEB_SEARCH_PROVIDER", "tavily", ("tavily",))
TAVILY_API_KEY = env_str("TAVILY_API_KEY", "")
TAVILY_ENDPOINT = env_str("TAVILY_ENDPOINT", "https://api.tavily.com/search")
# The TOTAL time of one provider request (connect to last byte), not a per-read timeout.
WEB_SEARCH_TIMEOUT_S = env_float("WEB_SEARCH_TIMEOUT_S", 10.0, minimum=0.1)
WEB_SEARCH_MAX_RESULTS = env_int("WEB_SEARCH_MAX_RESULTS", 5, minimum=1)
RATE_LIMITS.update(
    {
        op: env_rate(f"RATE_LIMIT_{op.upper()}", default)
        for op, default in {
            "store_memory": "60/minute",
            "recall_memory": "120/minute",
            "hybrid_search": "120/minute",
            "check_cache": "240/minute",
            "store_cache": "120/minute",
            "cache_invalidate": "60/minute",
            "search_web": "30/minute",
            "memory_health": "60/minute",
            "wipe_user_data": "5/hour",
            "store_decision": "120/minute",
            "recall_decision": "240/minute",
        }.items()
    }
)
CELERY_BEAT_SCHEDULE["toolkit-cache-purge"] = {"task": "toolkit.cache_purge_expired", "schedule": 600.0}
CELERY_BEAT_SCHEDULE["toolkit-enrich-pending"] = {"task": "toolkit.enrich_pending", "schedule": 300.0}
# Enrichment must not hold the worker's slots (billing, extraction, erasure wait behind it)
# while the LLM is slow or down: the sweep stops claiming candidates after this long (the
# rest wait for the next one), and any enrichment run uses heuristics for its remaining
# candidates after this many LLM failures in a row.
ENRICHMENT_SWEEP_BUDGET_S = env_float("ENRICHMENT_SWEEP_BUDGET_S", 60.0, minimum=0.0)
ENRICHMENT_LLM_BREAKER_FAILURES = env_int("ENRICHMENT_LLM_BREAKER_FAILURES", 3, minimum=1)
# --- Tenants, roles, delegated access (issue 12) -------------------------------------
# A service credential acting for users (X-Memory-Subject) has its own rate limit, this
# many times the per-user one, on top of each subject's.
RATE_LIMIT_CREDENTIAL_FACTOR = env_int("RATE_LIMIT_CREDENTIAL_FACTOR", 20, minimum=1)
# OIDC access tokens: the tenant comes from a claim (dotted path, e.g. `organization` or
# `tenant.name`), optionally mapped (`OIDC_TENANT_MAP=acme-corp:acme,globex:globex`);
# without a claim, every OIDC user is in OIDC_TENANT. A claimed tenant must exist.
OIDC_TENANT_CLAIM = env_str("OIDC_TENANT_CLAIM")
OIDC_TENANT_MAP = env_map("OIDC_TENANT_MAP")
OIDC_TENANT = env_str("OIDC_TENANT", "default")
# Roles from a claim (dotted path; Keycloak's `realm_access.roles` by default; a list or a
# space-separated string); the role names that mean tenant_admin and platform.
OIDC_ROLES_CLAIM = env_str("OIDC_ROLES_CLAIM", "realm_access.roles")
OIDC_ROLE_TENANT_ADMIN = env_str("OIDC_ROLE_TENANT_ADMIN", "memsite-tenant-admin")
OIDC_ROLE_PLATFORM = env_str("OIDC_ROLE_PLATFORM", "memsite-platform")
# --- MCP authorization server (issue 16, oauth/) ---
# Access tokens are short-lived and bound to the MCP resource they were granted for
# (RFC 8707); refresh tokens (scope offline_access) rotate on every use.
OAUTH_ACCESS_TOKEN_TTL_S = env_int("OAUTH_ACCESS_TOKEN_TTL_S", 3600, minimum=1)
OAUTH_REFRESH_TOKEN_TTL_S = env_int("OAUTH_REFRESH_TOKEN_TTL_S", 30 * 86400, minimum=1)
OAUTH_CODE_TTL_S = env_int("OAUTH_CODE_TTL_S", 60, minimum=1)
OAUTH_CONSENT_TTL_S = env_int("OAUTH_CONSENT_TTL_S", 600, minimum=1)
# Client ID metadata documents: fetched over https only, no redirects, size and time
# limits, public addresses only, cached.
OAUTH_CIMD_MAX_BYTES = env_int("OAUTH_CIMD_MAX_BYTES", 5120, minimum=1)
# The TOTAL time of one document fetch (connect, TLS, headers, body), not per read.
OAUTH_CIMD_TIMEOUT_S = env_float("OAUTH_CIMD_TIMEOUT_S", 3.0, minimum=0.1)
OAUTH_CIMD_CACHE_S = env_int("OAUTH_CIMD_CACHE_S", 3600, minimum=0)
# Tests only: let a metadata document be served on 127.0.0.1 (still https), trusting this CA file.
OAUTH_CIMD_ALLOW_LOOPBACK = env_bool("OAUTH_CIMD_ALLOW_LOOPBACK", False)
OAUTH_CIMD_CA_FILE = env_str("OAUTH_CIMD_CA_FILE")

# --- Issue 14: crypto-shredding of audit content ----------------------------------------
# Wraps every user's data key (AES-256-GCM; 32 bytes, base64: `openssl rand -base64 32`).
# Derived from SECRET_KEY in local development; required in production (kept apart from
# SECRET_KEY so rotating one does not touch the other). Losing it makes every sealed audit
# snapshot unreadable.
AUDIT_MASTER_KEY = env_str("AUDIT_MASTER_KEY", "")
if not AUDIT_MASTER_KEY and not LOCAL_DEV:
    raise ConfigError("AUDIT_MASTER_KEY must be set when MEMSITE_ENV=production (openssl rand -base64 32)")
if AUDIT_MASTER_KEY:
    import base64 as _base64
    import binascii as _binascii

    try:
        _decoded_master = _base64.b64decode(AUDIT_MASTER_KEY, validate=True)
    except _binascii.Error:
        _decoded_master = b""
    if len(_decoded_master) != 32:
        raise ConfigError("AUDIT_MASTER_KEY must be 32 random bytes, base64-encoded (openssl rand -base64 32)")
