"""File formats for taking memories out and bringing them in: pure functions, no database.

- memsite JSONL (lossless): a header line `{"format": "memsite.memories", "version": 1,
  "count": N, ...}`, then one memory per line with every field (text, pinned, metadata,
  source, client app, times, memory_type, tags, importance, agent_id, session_id,
  expires_at, why_stored, recall counters) and its history versions. The header's count
  makes a file cut at a line boundary detectable as truncated. Live memories only: the
  trash is not exported (it is on its way out; restore first to take a memory along).
- Markdown (export only): for people to read.
- mem0: `get_all` output or its export JSON, `{"results": [{"id", "memory", "metadata",
  "created_at", "updated_at", ...}]}` (a bare list is accepted too).
- OpenMemory: the zip its `/api/v1/backup/export` writes (`memories.json` with `memories`
  and `apps`, `categories`, `memory_categories`; `memories.jsonl.gz` is a derived copy and
  not needed). Categories become tags; archived memories come in, deleted ones do not.

`import_items_parse` validates the WHOLE file before anything is written and raises one
ServiceError naming the first bad record (never its content)."""

from __future__ import annotations

import io
import json
import zipfile
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from core.errors import ErrorCode, ServiceError
from memories import schemas
from memories.engine import engine_timestamp

FORMAT_NAME = "memsite.memories"
FORMAT_VERSION = 1
IMPORT_SOURCES = ("memsite", "mem0", "openmemory")
EXPORT_FORMATS = ("jsonl", "markdown")
HISTORY_EVENTS = frozenset({"ADD", "UPDATE", "DELETE", "NONE", "RESTORE"})
HISTORY_MAX_VERSIONS = 1000
LABEL_MAX_CHARS = 100
# OpenMemory memories in these states are gone for their user; they are not brought in.
OPENMEMORY_SKIPPED_STATES = frozenset({"deleted"})


@dataclass(frozen=True)
class ImportItem:
    text: str
    pinned: bool
    metadata: dict[str, Any]
    source: str
    client_app: str | None
    created_at: str | None
    updated_at: str | None
    versions: list[dict[str, Any]] = field(default_factory=list)
    # memory_type, tags, importance, agent_id, session_id, why_stored (validated like
    # remember's) and expires_at (engine text; may be past: the service skips those).
    fields: dict[str, Any] = field(default_factory=dict)
    access_count: int = 0
    last_recalled_at: str | None = None


def _invalid(message: str) -> ServiceError:
    return ServiceError(ErrorCode.INVALID_ARGUMENT, message)


def _timestamp(value: Any, *, where: str) -> str | None:
    """ISO-8601 in UTC (naive times are taken as UTC) in the engine's one text form, so
    stored times compare as text."""
    if value is None or value == "":
        return None
    if not isinstance(value, str) or len(value) > 64:
        raise _invalid(f"{where}: timestamp must be ISO-8601 text")
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise _invalid(f"{where}: timestamp is not ISO-8601") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return engine_timestamp(when)


def _label(value: Any, *, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > LABEL_MAX_CHARS:
        raise _invalid(f"{where}: must be text of at most {LABEL_MAX_CHARS} characters")
    return value


FIELD_KEYS = ("memory_type", "tags", "importance", "agent_id", "session_id", "why_stored")


def _checked(
    text: Any, pinned: Any, metadata: Any, *, where: str, fields: dict[str, Any] | None = None
) -> tuple[str, bool, dict[str, Any], dict[str, Any]]:
    """The same limits as `remember` (text size, metadata keys and sizes, field values).
    Returns text, pinned, metadata and the fields given (None values left out)."""
    given = {k: v for k, v in (fields or {}).items() if k in FIELD_KEYS and v is not None}
    arguments = {"memory": text, "pinned": pinned, "metadata": metadata or None, **given}
    try:
        valid = schemas.validate_input(schemas.RememberInput, arguments)
    except ServiceError as exc:
        raise ServiceError(exc.code, f"{where}: {exc.message}") from None
    checked = {k: getattr(valid, k) for k in given}
    return valid.memory.strip(), valid.pinned, dict(valid.metadata or {}), checked


def _count(value: Any, *, where: str) -> int:
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**31:
        raise _invalid(f"{where}: access_count must be a non-negative integer")
    return value


def _versions(raw: Any, *, where: str) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > HISTORY_MAX_VERSIONS:
        raise _invalid(f"{where}: history must be a list of at most {HISTORY_MAX_VERSIONS} versions")
    versions = []
    for n, version in enumerate(raw):
        here = f"{where} history[{n}]"
        if not isinstance(version, dict) or version.get("event") not in HISTORY_EVENTS:
            raise _invalid(f"{here}: needs an event (ADD, UPDATE, DELETE or NONE)")
        for key in ("old_memory", "new_memory"):
            value = version.get(key)
            if value is not None and (not isinstance(value, str) or len(value) > schemas.MEMORY_MAX_CHARS):
                raise _invalid(f"{here}: {key} must be text of at most {schemas.MEMORY_MAX_CHARS} characters")
        changed_by = version.get("changed_by") or ""
        if not isinstance(changed_by, str):
            raise _invalid(f"{here}: changed_by must be text")
        versions.append(
            {
                "event": version["event"],
                "old_memory": version.get("old_memory"),
                "new_memory": version.get("new_memory"),
                "created_at": _timestamp(version.get("created_at"), where=here),
                "updated_at": _timestamp(version.get("updated_at"), where=here),
                "changed_by": changed_by[:300],
            }
        )
    return versions


# --- parsing ------------------------------------------------------------------------------
def _parse_memsite(data: bytes) -> list[ImportItem]:
    try:
        lines = [line for line in data.decode("utf-8").split("\n") if line.strip()]
    except UnicodeDecodeError:
        raise _invalid("the file is not UTF-8 text") from None
    if not lines:
        raise _invalid("the file is empty")
    header = _json_line(lines[0], where="line 1")
    if not isinstance(header, dict) or header.get("format") != FORMAT_NAME:
        raise _invalid(f"line 1 is not a {FORMAT_NAME} header")
    if header.get("version") != FORMAT_VERSION:
        raise _invalid(f"format version {header.get('version')!r} is not supported (expected {FORMAT_VERSION})")
    count = header.get("count")
    if not isinstance(count, int) or count != len(lines) - 1:
        raise _invalid(f"the file is truncated: its header announces {count} memories, it holds {len(lines) - 1}")
    items = []
    for n, line in enumerate(lines[1:], start=2):
        where = f"line {n}"
        record = _json_line(line, where=where)
        if not isinstance(record, dict):
            raise _invalid(f"{where}: expected a JSON object")
        pinned_raw = record.get("pinned", False)
        text, pinned, metadata, fields = _checked(
            record.get("text"), pinned_raw, record.get("metadata"), where=where, fields=record
        )
        expires_at = _timestamp(record.get("expires_at"), where=f"{where} expires_at")
        if expires_at:
            fields["expires_at"] = expires_at
        items.append(
            ImportItem(
                text=text,
                pinned=pinned,
                metadata=metadata,
                source=_label(record.get("source"), where=f"{where} source") or "import",
                client_app=_label(record.get("client_app"), where=f"{where} client_app"),
                created_at=_timestamp(record.get("created_at"), where=where),
                updated_at=_timestamp(record.get("updated_at"), where=where),
                versions=_versions(record.get("history"), where=where),
                fields=fields,
                access_count=_count(record.get("access_count"), where=where),
                last_recalled_at=_timestamp(record.get("last_recalled_at"), where=f"{where} last_recalled_at"),
            )
        )
    return items


def _json_line(line: str, *, where: str) -> Any:
    try:
        return json.loads(line)
    except ValueError:
        raise _invalid(f"{where} is not valid JSON (is the file truncated?)") from None


def _parse_mem0(data: bytes) -> list[ImportItem]:
    document = _json_document(data, what="mem0 export")
    records = document.get("results") if isinstance(document, dict) else document
    if not isinstance(records, list):
        raise _invalid('a mem0 export is a JSON object with a "results" list')
    items = []
    for n, record in enumerate(records):
        where = f"results[{n}]"
        if not isinstance(record, dict):
            raise _invalid(f"{where}: expected a JSON object")
        metadata = record.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise _invalid(f"{where}: metadata must be an object")
        text, pinned, metadata, _ = _checked(record.get("memory"), False, metadata, where=where)
        items.append(
            ImportItem(
                text=text,
                pinned=pinned,
                metadata=metadata,
                source="mem0",
                client_app=None,
                created_at=_timestamp(record.get("created_at"), where=where),
                updated_at=_timestamp(record.get("updated_at"), where=where),
            )
        )
    return items


def _json_document(data: bytes, *, what: str) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise _invalid(f"the {what} is not valid JSON (is the file truncated?)") from None


def _parse_openmemory(data: bytes, *, max_bytes: int) -> list[ImportItem]:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            member = next(
                (i for i in archive.infolist() if not i.is_dir() and i.filename.rsplit("/", 1)[-1] == "memories.json"),
                None,
            )
            if member is None:
                raise _invalid("memories.json is missing from the OpenMemory zip")
            if member.file_size > max_bytes:  # a zip bomb is refused before inflating it
                raise ServiceError(ErrorCode.PAYLOAD_TOO_LARGE, f"memories.json exceeds {max_bytes} bytes")
            raw = archive.read(member)
    except (zipfile.BadZipFile, EOFError, OSError, zipfile.LargeZipFile):
        raise _invalid("the file is not a valid zip (is it truncated?)") from None
    document = _json_document(raw, what="OpenMemory memories.json")
    if not isinstance(document, dict) or not isinstance(document.get("memories"), list):
        raise _invalid('OpenMemory memories.json needs a "memories" list')
    apps = {a.get("id"): a.get("name") for a in document.get("apps") or [] if isinstance(a, dict)}
    category_names = {c.get("id"): c.get("name") for c in document.get("categories") or [] if isinstance(c, dict)}
    categories: dict[Any, list[str]] = {}
    for link in document.get("memory_categories") or []:
        name = category_names.get(link.get("category_id")) if isinstance(link, dict) else None
        if isinstance(name, str) and name.strip():
            categories.setdefault(link.get("memory_id"), []).append(name.strip())
    items = []
    for n, record in enumerate(document["memories"]):
        where = f"memories[{n}]"
        if not isinstance(record, dict):
            raise _invalid(f"{where}: expected a JSON object")
        if record.get("state") in OPENMEMORY_SKIPPED_STATES:
            continue
        metadata = record.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise _invalid(f"{where}: metadata must be an object")
        tags = categories.get(record.get("id")) or None
        text, pinned, metadata, fields = _checked(
            record.get("content"), False, metadata, where=where, fields={"tags": tags}
        )
        app = apps.get(record.get("app_id"))
        items.append(
            ImportItem(
                text=text,
                pinned=pinned,
                metadata=metadata,
                source="openmemory",
                client_app=_label(app, where=f"{where} app") if isinstance(app, str) else None,
                created_at=_timestamp(record.get("created_at"), where=where),
                updated_at=_timestamp(record.get("updated_at"), where=where),
                fields=fields,
            )
        )
    return items


def import_items_parse(*, data: bytes, source: str, max_bytes: int, max_memories: int) -> list[ImportItem]:
    """Every memory of the file, validated; raises ServiceError on the first problem."""
    if source not in IMPORT_SOURCES:
        raise _invalid(f"source must be one of {', '.join(IMPORT_SOURCES)}")
    if len(data) > max_bytes:
        raise ServiceError(ErrorCode.PAYLOAD_TOO_LARGE, f"the file exceeds {max_bytes} bytes")
    if source == "memsite":
        items = _parse_memsite(data)
    elif source == "mem0":
        items = _parse_mem0(data)
    else:
        items = _parse_openmemory(data, max_bytes=max_bytes)
    if len(items) > max_memories:
        raise ServiceError(ErrorCode.PAYLOAD_TOO_LARGE, f"the file holds more than {max_memories} memories")
    return items


# --- writing --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExportRecord:
    id: str
    text: str
    pinned: bool
    metadata: dict[str, Any]
    source: str | None
    client_app: str | None
    created_at: str | None
    updated_at: str | None
    memory_type: str
    tags: list[str]
    importance: float
    agent_id: str | None
    session_id: str | None
    expires_at: str | None
    why_stored: str | None
    last_recalled_at: str | None
    access_count: int
    history: list[dict[str, Any]]


def export_jsonl(records: list[ExportRecord], *, exported_at: str) -> str:
    header = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "count": len(records), "exported_at": exported_at}
    lines = [json.dumps(header, ensure_ascii=False)]
    lines += [json.dumps(asdict(r), ensure_ascii=False, default=str) for r in records]
    return "\n".join(lines) + "\n"


def _md_line(text: str) -> str:
    # One memory per list item: later lines indented so they stay inside the item.
    return text.replace("\r\n", "\n").replace("\n", "\n  ")


def export_markdown(records: list[ExportRecord], *, exported_at: str, username: str) -> str:
    out = [f"# Memories of {username}", "", f"{len(records)} memories, exported {exported_at}.", ""]
    pinned, others = [r for r in records if r.pinned], [r for r in records if not r.pinned]
    for title, group in (("Pinned", pinned), ("Memories", others)):
        if not group:
            continue
        out += [f"## {title}", ""]
        for r in group:
            out.append(f"- {_md_line(r.text)}")
            facts = [f"created {r.created_at or '?'}"]
            if r.updated_at and r.updated_at != r.created_at:
                facts.append(f"updated {r.updated_at}")
            if r.client_app:
                facts.append(f"via {r.client_app}")
            if r.memory_type != "user":
                facts.append(f"type {r.memory_type}")
            if r.tags:
                facts.append("tags " + ", ".join(r.tags))
            if r.expires_at:
                facts.append(f"expires {r.expires_at}")
            if len(r.history) > 1:
                facts.append(f"{len(r.history)} versions")
            facts += [f"{k}: {v}" for k, v in sorted(r.metadata.items())]
            out.append(f"  ({'; '.join(facts)})")
        out.append("")
    return "\n".join(out)
