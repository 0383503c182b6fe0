"""File formats for taking memories out and bringing them in: pure functions, no database.

- memsite JSONL (lossless): a header line `{"format": "memsite.memories", "version": 1,
  "count": N, ...}`, then one memory per line with every field (text, pinned, metadata,
  source, client app, times, memory_type, tags, importance, agent_id, session_id,
  expires_at, why_stored, recall counters) and its history versions (the newest
  HISTORY_MAX_VERSIONS; `history_omitted` counts older ones left out). The header's count
  makes a file cut at a line boundary detectable as truncated. Live memories only: the
  trash is not exported (it is on its way out; restore first to take a memory along).
- Markdown (export only): for people to read.
- mem0: `get_all` output or its export JSON, `{"results": [{"id", "memory", "metadata",
  "created_at", "updated_at", "agent_id", "run_id", "expiration_date", ...}]}` (a bare list
  is accepted too); keys in `metadata` that memsite reserves come in as `mem0_<key>`, and
  so do the top-level `actor_id`, `role` and `attributed_to` (outside the owner's budget).
- OpenMemory: the zip its `/api/v1/backup/export` writes (`memories.json` with `memories`
  and `apps`, `categories`, `memory_categories`; `memories.jsonl.gz` is a derived copy and
  not needed). Categories become tags; archived memories come in, deleted ones do not; keys
  in `metadata` that memsite reserves come in as `openmemory_<key>`.

`import_items_parse` validates the WHOLE file before anything is written and raises one
ServiceError naming the first bad record (never its content)."""

from __future__ import annotations

import io
import json
import lzma
import zipfile
import zlib
from dataclasses import asdict, dataclass, field
from datetime import UTC, date, datetime, time
from typing import Any

from core.errors import ErrorCode, ServiceError
from core.inputs import MAX_JSON_DEPTH, InputError, json_depth_check, json_loads_safe, json_value_check, text_problem
from memories import schemas
from memories.engine import ENRICHMENT_CLAIM_KEY, TIER_KEY, engine_timestamp

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
    # The memory's id where it was exported (memsite files): only to follow links between
    # the file's memories (a store_memory candidate's `stm_id`); the import makes new ids.
    exported_id: str | None = None

    @property
    def kind(self) -> tuple[str, str, str, str, str]:
        """What lets two memories with equal texts live side by side in one user's data:
        the toolkit keeps a short-term copy (`tier: stm`, expiring) beside the long-term
        memory of the same message, a memory type or an expiry makes a different memory
        of the same words, and a store narrowed to an agent or session keeps its own copy
        of a text the user has outside them (`services._remember_narrowed`). Equal texts
        of the same kind are one memory twice."""
        tier = self.metadata.get(TIER_KEY)
        return (
            tier if isinstance(tier, str) else "",
            self.fields.get("expires_at") or "",
            self.fields.get("memory_type") or "user",
            self.fields.get("agent_id") or "",
            self.fields.get("session_id") or "",
        )

    @property
    def holds_hash_first(self) -> bool:
        """Whether this one, of equal texts, should hold the text's dedupe hash: as in
        live data, the long-term memory rather than a short-term or expiring copy."""
        return self.metadata.get(TIER_KEY) != "stm" and not self.fields.get("expires_at")


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
    try:
        return engine_timestamp(when)
    except OverflowError:  # 9999-12-31 at -05:00 is past year 9999 in UTC (0001-01-01 at +05:00 before year 1)
        raise _invalid(f"{where}: timestamp is out of range") from None


def _text(value: Any, *, where: str, max_chars: int) -> str:
    """A string from the file that is stored as it is: Postgres refuses NUL and lone
    surrogates, so they must be a coded refusal here, not a database error later."""
    if not isinstance(value, str) or len(value) > max_chars:
        raise _invalid(f"{where}: must be text of at most {max_chars} characters")
    problem = text_problem(value)
    if problem:
        raise _invalid(f"{where}: {problem}")
    return value


def _label(value: Any, *, where: str) -> str | None:
    if value is None:
        return None
    return _text(value, where=where, max_chars=LABEL_MAX_CHARS)


def _key(value: Any, *, where: str) -> str | int | None:
    """An id OpenMemory links records by: text or an integer (or absent). Anything else
    (a list, an object) could not even be looked up, so the file is refused."""
    if value is None or isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise _invalid(f"{where} must be text or an integer")


FIELD_KEYS = ("memory_type", "tags", "importance", "agent_id", "session_id", "why_stored")


def _checked(
    text: Any,
    pinned: Any,
    metadata: Any,
    *,
    where: str,
    fields: dict[str, Any] | None = None,
    model: type[schemas.RememberInput] = schemas.RememberInput,
) -> tuple[str, bool, dict[str, Any], dict[str, Any]]:
    """The same limits as `remember` (text size, metadata keys and sizes, field values),
    or for a memsite file `schemas.StoredMemoryInput`'s: what the product stores, which is
    more than a client may set (the system's tags and metadata keys come on top).
    Returns text, pinned, metadata and the fields given (None values left out)."""
    given = {k: v for k, v in (fields or {}).items() if k in FIELD_KEYS and v is not None}
    arguments = {"memory": text, "pinned": pinned, "metadata": metadata or None, **given}
    try:
        valid = schemas.validate_input(model, arguments)
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
        event = version.get("event") if isinstance(version, dict) else None
        # Type first: a list or object is unhashable and cannot be looked up in the set.
        if not isinstance(version, dict) or not isinstance(event, str) or event not in HISTORY_EVENTS:
            raise _invalid(f"{here}: needs an event (ADD, UPDATE, DELETE or NONE)")
        texts: dict[str, str | None] = {}
        for key in ("old_memory", "new_memory"):
            value = version.get(key)
            limit = schemas.MEMORY_MAX_CHARS
            texts[key] = None if value is None else _text(value, where=f"{here} {key}", max_chars=limit)
        changed_by = version.get("changed_by") or ""
        if not isinstance(changed_by, str):
            raise _invalid(f"{here}: changed_by must be text")
        changed_by = _text(changed_by[:300], where=f"{here} changed_by", max_chars=300)
        versions.append(
            {
                "event": event,
                **texts,
                "created_at": _timestamp(version.get("created_at"), where=f"{here} created_at"),
                "updated_at": _timestamp(version.get("updated_at"), where=f"{here} updated_at"),
                "changed_by": changed_by,
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
        # Not quoted: the header is the file's content.
        raise _invalid(f"this format version is not supported (expected {FORMAT_VERSION})")
    count = header.get("count")
    if not isinstance(count, int) or isinstance(count, bool):
        raise _invalid("line 1: the header's count must be an integer")
    if count != len(lines) - 1:
        raise _invalid(f"the file is truncated: its header announces {count} memories, it holds {len(lines) - 1}")
    items = []
    for n, line in enumerate(lines[1:], start=2):
        where = f"line {n}"
        record = _json_line(line, where=where)
        if not isinstance(record, dict):
            raise _invalid(f"{where}: expected a JSON object")
        pinned_raw = record.get("pinned", False)
        text, pinned, metadata, fields = _checked(
            record.get("text"),
            pinned_raw,
            _metadata_of_export(record.get("metadata")),
            where=where,
            fields=record,
            model=schemas.StoredMemoryInput,
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
                created_at=_timestamp(record.get("created_at"), where=f"{where} created_at"),
                updated_at=_timestamp(record.get("updated_at"), where=f"{where} updated_at"),
                versions=_versions(record.get("history"), where=where),
                fields=fields,
                access_count=_count(record.get("access_count"), where=where),
                last_recalled_at=_timestamp(record.get("last_recalled_at"), where=f"{where} last_recalled_at"),
                exported_id=record["id"] if isinstance(record.get("id"), str) else None,
            )
        )
    return items


def _metadata_of_export(metadata: Any) -> Any:
    """A memsite record's metadata without an enrichment lease: files exported before the
    lease became an engine key (not metadata) carry it while a candidate was being
    enriched; it means nothing in another database (the candidate is enriched there anew)."""
    if isinstance(metadata, dict) and ENRICHMENT_CLAIM_KEY in metadata:
        return {k: v for k, v in metadata.items() if k != ENRICHMENT_CLAIM_KEY}
    return metadata


def _json_line(line: str, *, where: str) -> Any:
    # One memory per line: the project's limits for one JSON value hold (the record's
    # metadata sits as deep in it as in `remember`'s arguments).
    try:
        return json_loads_safe(line)
    except InputError as exc:
        if exc.too_large:
            raise ServiceError(ErrorCode.PAYLOAD_TOO_LARGE, f"{where}: {exc.message}") from None
        if exc.message.startswith("not valid JSON"):  # rather than too deep or a bad string
            raise _invalid(f"{where} is not valid JSON (is the file truncated?)") from None
        raise _invalid(f"{where}: {exc.message}") from None


def _parse_mem0(data: bytes) -> list[ImportItem]:
    """Each record of mem0's `get_all`. Not carried: `id` (memsite makes new ids, as for
    every file), `user_id` (the importing user owns them) and `hash`, mem0's md5 of the
    text, which the engine computes again for the stored text (a copy in the metadata
    would take a place of the owner's 20 keys and be wrong after the first edit)."""
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
        metadata = _mem0_speaker_carried(record, _mem0_keys_renamed(metadata, where=where), where=where)
        text, pinned, metadata, _ = _checked(
            record.get("memory"), False, metadata, where=where, model=schemas.Mem0MemoryInput
        )
        items.append(
            ImportItem(
                text=text,
                pinned=pinned,
                metadata=metadata,
                source="mem0",
                client_app=None,
                created_at=_timestamp(record.get("created_at"), where=f"{where} created_at"),
                updated_at=_timestamp(record.get("updated_at"), where=f"{where} updated_at"),
                fields=_mem0_fields(record, where=where),
            )
        )
    return items


MEM0_KEY_PREFIX = "mem0_"
OPENMEMORY_KEY_PREFIX = "openmemory_"


def _mem0_keys_renamed(metadata: dict[str, Any], *, where: str, prefix: str = MEM0_KEY_PREFIX) -> dict[str, Any]:
    """A mem0 memory's metadata with every key memsite reserves renamed `mem0_<key>`:
    mem0 puts some there itself (its procedural memories' `memory_type`), and the rest
    (`source`, `pinned`, `client_app`, ...) are the owner's own labels in mem0, where
    nothing reserves them. Which is which cannot be told, and refusing either refused
    the whole file. A key whose new name the metadata already holds is still refused (by
    position: the key may be the owner's text), as is a key no name could carry.
    OpenMemory, built on mem0, reserves none of them either: its keys get `prefix`
    `openmemory_`."""
    if not schemas.RESERVED_KEYS.intersection(metadata):
        return metadata
    renamed: dict[str, Any] = {}
    for n, (key, value) in enumerate(metadata.items(), start=1):
        name = prefix + key if key in schemas.RESERVED_KEYS else key
        if name != key and name in metadata:
            raise _invalid(
                f"{where}: metadata: metadata key #{n} ({key!r}) is reserved, and its new name {name!r} is taken"
            )
        renamed[name] = value
    return renamed


# Who said a mem0 memory, which mem0's `get_all` gives beside `agent_id` and `run_id`:
# `role` and `actor_id` (the message's role and `name`) of a memory added verbatim
# (`infer=False`), `attributed_to` ("user" or "assistant", the LLM's answer) of an
# extracted one. memsite has no such fields (its own rows' engine `role` is always "user"
# and not shown), so they come in as metadata, named as the renamed keys are, outside the
# owner's 20 keys and 8 KiB (schemas.MEM0_SPEAKER_KEYS).
MEM0_SPEAKER_FIELDS = schemas.MEM0_SPEAKER_FIELDS


def _mem0_speaker_carried(record: dict[str, Any], metadata: dict[str, Any], *, where: str) -> dict[str, Any]:
    """The metadata with the record's speaker fields added as `mem0_<field>`, after the
    file's own keys (errors name metadata keys by position). One that `metadata` holds
    too (renamed already) with the same value is one key; with another, it is refused."""
    carried = dict(metadata)
    for key in MEM0_SPEAKER_FIELDS:
        value = record.get(key)
        if value is None or value == "":
            continue
        if not isinstance(value, str):  # mem0 writes text: a message's role and name, the LLM's label
            raise _invalid(f"{where} {key} must be text")
        if len(value) > schemas.METADATA_VALUE_MAX_CHARS:
            raise ServiceError(
                ErrorCode.PAYLOAD_TOO_LARGE, f"{where} {key} exceeds {schemas.METADATA_VALUE_MAX_CHARS} characters"
            )
        name = MEM0_KEY_PREFIX + key
        if name in carried and carried[name] != value:
            raise _invalid(f"{where} {key} comes in as metadata key {name!r}, which its metadata holds already")
        carried[name] = value
    return carried


class _Mem0Scopes(schemas.StrictInput):
    """A mem0 memory's agent and run, with the types every surface gives a memory's
    agent and session."""

    agent_id: schemas.ScopeId | None = None
    run_id: schemas.ScopeId | None = None


def _mem0_fields(record: dict[str, Any], *, where: str) -> dict[str, Any]:
    """The fields a mem0 memory carries at its top level: `agent_id`, `run_id` (our
    `session_id`) and `expiration_date` (our `expires_at`; a passed one makes the memory
    skipped and counted as expired, as a memsite record's)."""
    given = {key: record.get(key) for key in ("agent_id", "run_id") if record.get(key) not in (None, "")}
    try:
        scopes = schemas.validate_input(_Mem0Scopes, given)
    except ServiceError as exc:
        raise ServiceError(exc.code, f"{where}: {exc.message}") from None
    fields = {"agent_id": scopes.agent_id, "session_id": scopes.run_id}
    fields["expires_at"] = _mem0_expiry(record.get("expiration_date"), where=f"{where} expiration_date")
    return {key: value for key, value in fields.items() if value is not None}


def _mem0_expiry(value: Any, *, where: str) -> str | None:
    """mem0's expiration date as our expiry instant: mem0 shows a memory through that
    date (UTC) and hides it from the next, so it expires at the end of that day in UTC.
    A date-time (not what mem0 writes, but an ISO 8601 instant) is taken as it is."""
    if value is None or value == "":
        return None
    if not isinstance(value, str) or len(value) > 64:
        raise _invalid(f"{where}: must be a date, e.g. 2026-12-31")
    try:
        day = date.fromisoformat(value)
    except ValueError:
        return _timestamp(value, where=where)
    return engine_timestamp(datetime.combine(day, time.max, tzinfo=UTC))


# A memory's metadata sits two levels deeper in a mem0 or OpenMemory document
# (`results[n].metadata`) than in `remember`'s arguments.
DOCUMENT_MAX_DEPTH = MAX_JSON_DEPTH + 2


def _json_document(data: bytes, *, what: str) -> Any:
    """The whole file as one JSON value, with json_loads_safe's checks (depth counted
    before parsing, finite numbers, no NUL or lone surrogates anywhere) but not its
    20,000-value cap, which one value of an import may exceed many times over (20,000
    memories): the file's size (IMPORT_MAX_BYTES, checked before) bounds the work."""
    try:
        text = data.decode("utf-8")
        json_depth_check(text, max_depth=DOCUMENT_MAX_DEPTH)
        value = json.loads(text)
        json_value_check(value, max_depth=DOCUMENT_MAX_DEPTH, max_nodes=len(text) + 1)
    except InputError as exc:
        raise _invalid(f"the {what}: {exc.message}") from None
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _invalid(f"the {what} is not valid JSON (is the file truncated?)") from None
    return value


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
    except (zipfile.BadZipFile, EOFError, OSError, zipfile.LargeZipFile, zlib.error, lzma.LZMAError):
        raise _invalid("the file is not a valid zip (is it truncated?)") from None
    except (RuntimeError, NotImplementedError):  # zipfile's errors for these, not bugs of ours
        raise _invalid("memories.json in the zip is encrypted or uses an unsupported compression method") from None
    document = _json_document(raw, what="OpenMemory memories.json")
    if not isinstance(document, dict) or not isinstance(document.get("memories"), list):
        raise _invalid('OpenMemory memories.json needs a "memories" list')
    # Every id is type-checked before it is used as a dict key: a list or an object in
    # the file would otherwise be a TypeError (a 500), not a coded refusal.
    apps = {
        _key(a.get("id"), where=f"apps[{n}] id"): a.get("name")
        for n, a in enumerate(_om_list(document, "apps"))
        if isinstance(a, dict)
    }
    category_names = {
        _key(c.get("id"), where=f"categories[{n}] id"): c.get("name")
        for n, c in enumerate(_om_list(document, "categories"))
        if isinstance(c, dict)
    }
    categories: dict[Any, list[str]] = {}
    for n, link in enumerate(_om_list(document, "memory_categories")):
        if not isinstance(link, dict):
            continue
        name = category_names.get(_key(link.get("category_id"), where=f"memory_categories[{n}] category_id"))
        memory_id = _key(link.get("memory_id"), where=f"memory_categories[{n}] memory_id")
        if isinstance(name, str) and name.strip():
            categories.setdefault(memory_id, []).append(name.strip())
    items = []
    for n, record in enumerate(document["memories"]):
        where = f"memories[{n}]"
        if not isinstance(record, dict):
            raise _invalid(f"{where}: expected a JSON object")
        state = record.get("state")
        if state is not None and not isinstance(state, str):
            raise _invalid(f"{where} state must be text")
        if state in OPENMEMORY_SKIPPED_STATES:
            continue
        metadata = record.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise _invalid(f"{where}: metadata must be an object")
        tags = categories.get(_key(record.get("id"), where=f"{where} id")) or None
        metadata = _mem0_keys_renamed(metadata, where=where, prefix=OPENMEMORY_KEY_PREFIX)
        text, pinned, metadata, fields = _checked(
            record.get("content"), False, metadata, where=where, fields={"tags": tags}
        )
        app = apps.get(_key(record.get("app_id"), where=f"{where} app_id"))
        items.append(
            ImportItem(
                text=text,
                pinned=pinned,
                metadata=metadata,
                source="openmemory",
                client_app=_label(app, where=f"{where} app") if isinstance(app, str) else None,
                created_at=_timestamp(record.get("created_at"), where=f"{where} created_at"),
                updated_at=_timestamp(record.get("updated_at"), where=f"{where} updated_at"),
                fields=fields,
            )
        )
    return items


def _om_list(document: dict[str, Any], key: str) -> list[Any]:
    """One of memories.json's optional lists (absent or null: empty)."""
    value = document.get(key)
    if not value:  # absent, null or empty
        return []
    if not isinstance(value, list):
        raise _invalid(f'OpenMemory memories.json: "{key}" must be a list')
    return value


# An export has no size limit (a user's data always comes out); one import call takes at
# most IMPORT_MAX_BYTES and IMPORT_MAX_MEMORIES (a web request must stay bounded). A larger
# export is refused whole with this way in: an operator's import, limits raised for its run.
LARGER_FILES = (
    "an operator can import it: manage.py import_memories with IMPORT_MAX_BYTES and IMPORT_MAX_MEMORIES raised"
)


def import_items_parse(*, data: bytes, source: str, max_bytes: int, max_memories: int) -> list[ImportItem]:
    """Every memory of the file, validated; raises ServiceError on the first problem."""
    if source not in IMPORT_SOURCES:
        raise _invalid(f"source must be one of {', '.join(IMPORT_SOURCES)}")
    if len(data) > max_bytes:
        raise ServiceError(ErrorCode.PAYLOAD_TOO_LARGE, f"the file exceeds {max_bytes} bytes ({LARGER_FILES})")
    if source == "memsite":
        items = _parse_memsite(data)
    elif source == "mem0":
        items = _parse_mem0(data)
    else:
        items = _parse_openmemory(data, max_bytes=max_bytes)
    if len(items) > max_memories:
        raise ServiceError(
            ErrorCode.PAYLOAD_TOO_LARGE, f"the file holds more than {max_memories} memories ({LARGER_FILES})"
        )
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
    # Older versions left out: a record holds the newest HISTORY_MAX_VERSIONS, as many as
    # the import takes (a memory changed more often than that must still come back).
    history_omitted: int = 0


def _record_line(record: ExportRecord) -> str:
    data = asdict(record)
    if not data["history_omitted"]:  # said only where versions were left out
        del data["history_omitted"]
    return json.dumps(data, ensure_ascii=False, default=str)


def export_jsonl_header(*, count: int, exported_at: str) -> str:
    header = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "count": count, "exported_at": exported_at}
    return json.dumps(header, ensure_ascii=False) + "\n"


def export_jsonl_line(record: ExportRecord) -> str:
    return _record_line(record) + "\n"


def _md_line(text: str) -> str:
    # One memory per list item: later lines indented so they stay inside the item.
    return text.replace("\r\n", "\n").replace("\n", "\n  ")


def export_markdown_title(*, count: int, exported_at: str, username: str) -> str:
    return f"# Memories of {username}\n\n{count} memories, exported {exported_at}.\n"


def export_markdown_section(pinned: bool) -> str:
    """The heading of a group: pinned memories come first, then the others."""
    return "\n## Pinned\n\n" if pinned else "\n## Memories\n\n"


def export_markdown_item(r: ExportRecord) -> str:
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
    if r.history_omitted:
        facts.append(f"{len(r.history)} newest of {len(r.history) + r.history_omitted} versions")
    elif len(r.history) > 1:
        facts.append(f"{len(r.history)} versions")
    facts += [f"{k}: {v}" for k, v in sorted(r.metadata.items())]
    return f"- {_md_line(r.text)}\n  ({'; '.join(facts)})\n"
