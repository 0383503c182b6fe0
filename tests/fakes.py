"""Real HTTP servers on 127.0.0.1 standing in for external services: an
OpenAI-compatible LLM, the Gemini API and an OIDC provider. Each records what it was
sent so tests can look at prompts and calls."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit


class FakeServer:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output quiet
                pass

            def _reply(self, status: int, body: Any) -> None:
                if status in (301, 302, 303):
                    self.send_response(status)
                    self.send_header("Location", body)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802 - http.server API
                status, body = fake.handle("GET", self.path, self.headers, None)
                self._reply(status, body)

            def do_POST(self):  # noqa: N802
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                if "application/x-www-form-urlencoded" in (self.headers.get("Content-Type") or ""):
                    payload = {k: v[0] for k, v in parse_qs(raw.decode()).items()}
                else:
                    payload = json.loads(raw) if raw else None
                headers = {k.lower(): v for k, v in self.headers.items()}
                fake.requests.append({"path": self.path, "headers": headers, "json": payload})
                status, body = fake.handle("POST", self.path, self.headers, payload)
                self._reply(status, body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def start(self) -> FakeServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def handle(self, method: str, path: str, headers, payload) -> tuple[int, Any]:
        raise NotImplementedError


class FakeLLM(FakeServer):
    """Answers every extraction call with the next queued list of facts (or none)."""

    def __init__(self) -> None:
        super().__init__()
        self.queued: list[list[str]] = []
        self.answers: list[str] = []
        self.lock = threading.Lock()
        # `hold()` keeps every chat call waiting (until `release()`), as a slow LLM would;
        # `held` counts the calls that arrived and are waiting (one release per call).
        self.gate = threading.Event()
        self.gate.set()
        self.held = threading.Semaphore(0)
        self.fail_next = 0  # answer 503 to this many chat calls (an LLM that is down)

    def hold(self) -> None:
        self.gate.clear()

    def release(self) -> None:
        self.gate.set()

    def wait_held(self, calls: int = 1, timeout: float = 30) -> None:
        """Block until `calls` more chat calls are waiting at the held gate."""
        for _ in range(calls):
            if not self.held.acquire(timeout=timeout):
                raise AssertionError("the LLM was not called while held")

    def _gate(self) -> None:
        if not self.gate.is_set():
            self.held.release()
            self.gate.wait(60)

    def stop(self) -> None:
        self.release()  # a held call must not keep the server from closing
        super().stop()

    def queue_facts(self, *facts: str) -> None:
        with self.lock:
            self.queued.append(list(facts))

    def queue_answer(self, answer: dict[str, Any]) -> None:
        """The next call's whole answer (a JSON object), e.g. an enrichment's."""
        with self.lock:
            self.answers.append(json.dumps(answer))

    def _failing(self) -> bool:
        with self.lock:
            failing = self.fail_next > 0
            self.fail_next -= 1 if failing else 0
        return failing

    def _next_content(self) -> str:
        with self.lock:
            if self.answers:
                return self.answers.pop(0)
            facts = self.queued.pop(0) if self.queued else []
        return json.dumps({"memory": [{"text": fact} for fact in facts]})

    def prompts(self) -> list[str]:
        raise NotImplementedError


class FakeOpenAI(FakeLLM):
    def handle(self, method, path, headers, payload):
        if method == "POST" and path.endswith("/chat/completions"):
            self._gate()
            if self._failing():
                return 503, {"error": {"message": "the model is overloaded"}}
            return 200, {
                "id": "chatcmpl-fake",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": payload.get("model", "fake"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": self._next_content()},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        return 404, {"error": {"message": f"no route {path}"}}

    def prompts(self) -> list[str]:
        return [
            "\n".join(m["content"] for m in r["json"]["messages"])
            for r in self.requests
            if r["path"].endswith("/chat/completions")
        ]


def fake_embedding(text: str, dims: int) -> list[float]:
    """A deterministic bag-of-words vector (hashed words, unit length): texts sharing
    words are near, so search over fake Gemini vectors still finds the right memory."""
    vector = [0.0] * dims
    for word in re.findall(r"[a-z0-9]+", text.lower()):
        vector[int(hashlib.sha256(word.encode()).hexdigest(), 16) % dims] += 1.0
    norm = sum(x * x for x in vector) ** 0.5 or 1.0
    return [x / norm for x in vector] if any(vector) else [1.0] + [0.0] * (dims - 1)


class FakeGemini(FakeLLM):
    embed_failures = 0  # answer this many embedding calls with a 500 (a crash mid-run)
    embed_delay = 0.0  # seconds per embedding call (a run slow enough to be killed midway)

    def handle(self, method, path, headers, payload):
        if method == "POST" and ":batchEmbedContents" in path:
            time.sleep(self.embed_delay)
            if self.embed_failures > 0:
                self.embed_failures -= 1
                return 500, {"error": {"code": 500, "message": "fake outage", "status": "INTERNAL"}}
            embeddings = []
            for request in (payload or {}).get("requests", []):
                text = " ".join(p.get("text", "") for p in request.get("content", {}).get("parts", []))
                embeddings.append({"values": fake_embedding(text, int(request.get("outputDimensionality") or 768))})
            return 200, {"embeddings": embeddings}
        if method == "POST" and ":generateContent" in path:
            return 200, {
                "candidates": [
                    {"content": {"role": "model", "parts": [{"text": self._next_content()}]}, "finishReason": "STOP"}
                ],
                "usageMetadata": {"promptTokenCount": 1, "candidatesTokenCount": 1, "totalTokenCount": 2},
                "modelVersion": "fake",
            }
        return 404, {"error": {"code": 404, "message": f"no route {path}", "status": "NOT_FOUND"}}

    def prompts(self) -> list[str]:
        texts = []
        for request in self.requests:
            body = request["json"] or {}
            parts = [p.get("text", "") for c in body.get("contents", []) for p in c.get("parts", [])]
            system = body.get("systemInstruction") or body.get("system_instruction") or {}
            parts += [p.get("text", "") for p in system.get("parts", [])]
            texts.append("\n".join(parts))
        return texts


def _b64url(number: int) -> str:
    raw = number.to_bytes((number.bit_length() + 7) // 8, "big")
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


class FakeOIDC(FakeServer):
    """An OIDC provider: discovery, JWKS, an authorize endpoint that signs in
    `self.login_as` at once, and a token endpoint that checks PKCE."""

    def __init__(self) -> None:
        from cryptography.hazmat.primitives.asymmetric import rsa

        super().__init__()
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.kid = "test-key-1"
        self.client_id = "memsite-web"
        self.login_as = {"sub": "web-user-1", "email": "erin@example.com", "preferred_username": "erin"}
        self.codes: dict[str, dict] = {}

    @property
    def issuer(self) -> str:
        return self.url

    def handle(self, method, path, headers, payload):
        if path == "/.well-known/openid-configuration":
            return 200, {
                "issuer": self.issuer,
                "jwks_uri": f"{self.url}/jwks",
                "authorization_endpoint": f"{self.url}/authorize",
                "token_endpoint": f"{self.url}/token",
                "end_session_endpoint": f"{self.url}/logout",
            }
        if path.startswith("/authorize"):
            return self._authorize({k: v[0] for k, v in parse_qs(urlsplit(path).query).items()})
        if path == "/token" and method == "POST":
            return self._token(payload or {})
        if path == "/jwks":
            numbers = self.key.public_key().public_numbers()
            jwk = {"kty": "RSA", "kid": self.kid, "use": "sig", "alg": "RS256"}
            return 200, {"keys": [{**jwk, "n": _b64url(numbers.n), "e": _b64url(numbers.e)}]}
        return 404, {"error": "not_found"}

    def _authorize(self, query: dict) -> tuple[int, Any]:
        if query.get("client_id") != self.client_id or query.get("code_challenge_method") != "S256":
            return 400, {"error": "invalid_request"}
        code = base64.urlsafe_b64encode(os.urandom(18)).decode()
        self.codes[code] = query
        return 302, f"{query['redirect_uri']}?{urlencode({'code': code, 'state': query['state']})}"

    def _token(self, form: dict) -> tuple[int, Any]:
        grant = self.codes.pop(form.get("code", ""), None)
        if grant is None or form.get("redirect_uri") != grant["redirect_uri"]:
            return 400, {"error": "invalid_grant"}
        verifier = form.get("code_verifier", "")
        challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).decode().rstrip("=")
        if challenge != grant["code_challenge"]:
            return 400, {"error": "invalid_grant", "error_description": "PKCE verification failed"}
        id_token = self.token(aud=self.client_id, nonce=grant.get("nonce"), **self.login_as)
        access = self.token(aud="memsite", azp=self.client_id, **self.login_as)
        return 200, {"access_token": access, "id_token": id_token, "token_type": "Bearer", "expires_in": 300}

    def token(self, *, key=None, kid: str | None = None, **claims) -> str:
        import jwt

        now = int(time.time())
        body = {"iss": self.issuer, "iat": now, "exp": now + 300, **claims}
        return jwt.encode(body, key or self.key, algorithm="RS256", headers={"kid": kid or self.kid})


class FakeGateway(FakeServer):
    """The payment gateway's usage-ingest endpoint, with failure modes to switch on."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.requests = []
            self.received: list[dict] = []  # every event in every request that got through
            self.fail_next = 0  # answer 503 to this many requests
            self.hang_next = 0  # sleep past the client's timeout on this many requests
            self.hang_s = 3.0
            self.slow_s = 0.0  # sleep this long before answering every request
            self.refuse_ids: set[str] = set()  # 422 for any batch holding one of these
            self.answer_status: int | None = None  # answer every request with this status
            self.started = threading.Event()

    def handle(self, method, path, headers, payload):
        if method != "POST" or path != "/usage":
            return 404, {"error": "not_found"}
        self.started.set()
        with self.lock:
            if self.fail_next:
                self.fail_next -= 1
                return 503, {"error": "busy"}
            if self.answer_status is not None:
                return self.answer_status, {"error": "answered as configured"}
            hang = self.hang_next > 0
            self.hang_next -= 1 if hang else 0
            events = payload["events"]
            if any(e["request_id"] in self.refuse_ids for e in events):
                return 422, {"error": "unknown user"}
        time.sleep(self.hang_s if hang else self.slow_s)
        with self.lock:
            self.received.extend(events)
        return 200, {"accepted": len(events)}

    def received_ids(self) -> list[str]:
        with self.lock:
            return [e["request_id"] for e in self.received]


def tool_messages_problem(messages: list[dict[str, Any]]) -> str | None:
    """OpenAI's rule for tool messages (a real upstream answers 400): each assistant
    message's tool_calls followed by a tool message for every call id, and no tool
    message that does not answer a tool call right before it."""
    open_calls: set[str] = set()
    for at, message in enumerate(messages):
        if message.get("role") == "tool":
            if message.get("tool_call_id") not in open_calls:
                return f"messages[{at}]: a tool message must answer a preceding message with 'tool_calls'."
            open_calls.discard(message["tool_call_id"])
            continue
        if open_calls:
            return (
                "An assistant message with 'tool_calls' must be followed by tool messages responding to each"
                f" 'tool_call_id'. Missing: {sorted(open_calls)} before messages[{at}]."
            )
        open_calls = {call["id"] for call in message.get("tool_calls") or []}
    if open_calls:
        return f"An assistant message with 'tool_calls' must be followed by tool messages: {sorted(open_calls)}."
    return None


class FakeChatUpstream:
    """An OpenAI-compatible chat upstream for the chat proxy (issue 15): answers
    /v1/chat/completions whole or as SSE (one chunk every `chunk_delay` seconds), with
    tool calls when asked, or a canned error status. Records what it was sent."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.reset()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # close-delimited bodies: SSE needs no length

            def log_message(self, *args):
                pass

            def do_POST(self):  # noqa: N802 - http.server API
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                payload = json.loads(raw) if raw else None
                fake.requests.append(
                    {"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}, "json": payload}
                )
                problem = tool_messages_problem((payload or {}).get("messages") or [])
                error = (400, {"error": {"message": problem, "type": "invalid_request_error"}}) if problem else None
                if error is not None or fake.error is not None:
                    status, body = error or fake.error
                    data = json.dumps(body).encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("X-Upstream", "fake")
                    if status == 429:
                        self.send_header("Retry-After", "7")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                if payload.get("stream"):
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("X-Upstream", "fake")
                    self.end_headers()
                    for number, chunk in enumerate(fake.stream_chunks(payload)):
                        self.wfile.write(chunk)
                        self.wfile.flush()
                        if number == 0 and fake.hold_after_first is not None:
                            # The rest waits until the test saw the first chunk (or 10 s).
                            fake.released_by_client = fake.hold_after_first.wait(10)
                        if fake.chunk_delay:
                            time.sleep(fake.chunk_delay)
                    return
                data = json.dumps(fake.completion(payload)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("X-Upstream", "fake")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def reset(self) -> None:
        self.requests.clear()
        self.reply = "Hello from upstream."
        self.tool_call: dict[str, str] | None = None
        self.error: tuple[int, Any] | None = None
        self.chunk_delay = 0.0
        # Set: a stream's chunks after the first wait for this event.
        self.hold_after_first: threading.Event | None = None
        self.released_by_client: bool | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def start(self) -> FakeChatUpstream:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def completion(self, payload: dict[str, Any]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.reply}
        if self.tool_call:
            message = {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "call_1", "type": "function", "function": dict(self.tool_call)}],
            }
        return {
            "id": "chatcmpl-upstream",
            "object": "chat.completion",
            "created": 1700000000,
            "model": payload.get("model", "fake"),
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if self.tool_call else "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
        }

    def stream_chunks(self, payload: dict[str, Any]) -> list[bytes]:
        base = {"id": "chatcmpl-upstream", "object": "chat.completion.chunk", "created": 1700000000}
        base["model"] = payload.get("model", "fake")
        deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
        if self.tool_call:
            name, arguments = self.tool_call["name"], self.tool_call["arguments"]
            first = {"index": 0, "id": "call_1", "type": "function", "function": {"name": name}}
            deltas.append({"tool_calls": [first]})
            half = len(arguments) // 2
            for part in (arguments[:half], arguments[half:]):
                deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": part}}]})
        else:
            words = self.reply.split(" ")
            deltas += [{"content": w if i == 0 else " " + w} for i, w in enumerate(words)]
        chunks = [{**base, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
        finish = "tool_calls" if self.tool_call else "stop"
        chunks.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
        return [f"data: {json.dumps(c)}\n\n".encode() for c in chunks] + [b"data: [DONE]\n\n"]


class FakeTavily(FakeServer):
    """Tavily's search endpoint (issue 14): answers with `results`, records what it got."""

    def __init__(self, *, status: int = 200, answer: dict | None = None) -> None:
        super().__init__()
        self.status = status
        self.answer = answer  # a fixed body instead of results for the query

    def handle(self, method, path, headers, payload):
        if self.status != 200:
            return self.status, {"detail": "nope"}
        if self.answer is not None:
            return 200, self.answer
        query = (payload or {}).get("query", "")
        return 200, {
            "query": query,
            "results": [
                {"title": f"About {query}", "url": "https://example.com/a", "content": "Snippet A", "score": 0.9},
                {"title": "Second", "url": "https://example.com/b", "content": "Snippet B", "score": 0.5},
            ],
        }


class DripServer:
    """A server on 127.0.0.1 that never finishes an answer: it reads a request, then sends
    what `pieces()` yields, each (bytes, pause after), until the pieces end, the client
    hangs up, it is stopped, or `stop_after_s` passed (so that a test of a missing
    deadline fails on its time instead of hanging). `wrap` wraps each accepted socket (TLS).
    Counts connections made (`connections`) and still open (`open`)."""

    def __init__(
        self,
        pieces: Any,
        *,
        wrap: Any = None,
        stop_after_s: float = 60.0,
    ) -> None:
        import socket

        self.pieces, self.wrap, self.stop_after_s = pieces, wrap, stop_after_s
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.stopped = threading.Event()
        self.connections = 0
        self.open = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()
        self._watchdog = threading.Timer(stop_after_s, self.stop)
        self._watchdog.daemon = True
        self._watchdog.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
                self.open += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Any) -> None:
        try:
            conn.settimeout(5)
            if self.wrap is not None:
                conn = self.wrap(conn)
            conn.recv(65536)
            for piece, pause in self.pieces():
                if self.stopped.is_set():
                    break
                conn.sendall(piece)
                time.sleep(pause)
        except OSError:
            pass  # the client hung up: what the tests want
        finally:
            conn.close()
            with self._lock:
                self.open -= 1

    def stop(self) -> None:
        self.stopped.set()
        self._watchdog.cancel()
        self.sock.close()


def dripped(data: bytes, pause: float) -> list[tuple[bytes, float]]:
    """`data` one byte at a time, `pause` after each (DripServer pieces)."""
    return [(bytes([byte]), pause) for byte in data]
