"""Helpers of the OAuth tests: a throwaway TLS CA, an https server on loopback for client
ID metadata documents, a live memsite allowed to fetch from it, PKCE, and a scripted user
who signs in and answers the consent page over plain HTTP."""

from __future__ import annotations

import asyncio
import base64
import datetime
import hashlib
import ipaddress
import json
import os
import re
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urlsplit

import httpx

from tests.conftest import billing_env, free_port, service_env, wait_for
from tests.environment import ROOT


def tls_files(directory: Path) -> tuple[Path, Path, Path]:
    """(ca.pem, cert.pem, key.pem): a CA and a certificate for 127.0.0.1 it signed."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "memsite test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = (directory / "ca.pem", directory / "cert.pem", directory / "key.pem")
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths


class DocumentServer:
    """https://127.0.0.1:<port>/<path> answering what `routes` says: (status, body, headers)."""

    def __init__(self, cert: Path, key: Path):
        self.routes: dict[str, tuple[int, bytes, dict[str, str]]] = {}
        self.hits: list[str] = []
        routes, hits = self.routes, self.hits

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                hits.append(self.path)
                status, body, headers = routes.get(self.path, (404, b"{}", {}))
                self.send_response(status)
                for name, value in {"Content-Type": "application/json", **headers}.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(str(cert), str(key))
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def document(self, path: str, body: dict, *, status: int = 200, headers: dict | None = None) -> str:
        self.routes[path] = (status, json.dumps(body).encode(), headers or {})
        return self.url + path

    def stop(self) -> None:
        self.server.shutdown()


def start_memsite(log_path: Path, env_extra: dict[str, str], fake_llm, fake_gateway_server):
    port = free_port()
    env = service_env(
        LLM_BASE_URL=f"{fake_llm.url}/v1",
        LLM_MODEL="fake-model",
        LLM_API_KEY="fake-key",
        **billing_env(fake_gateway_server),
        **env_extra,
    )
    env.pop("PUBLIC_BASE_URL", None)
    log = open(log_path, "ab")  # noqa: SIM115
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "memsite.asgi:application", "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    log.close()

    def up() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"live server exited:\n{log_path.read_text()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return True
        except OSError:
            return False

    wait_for(up, timeout=60, what="live server")

    def stop() -> None:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(30)

    return f"http://127.0.0.1:{port}", stop


def pkce() -> tuple[str, str]:
    verifier = secrets.token_urlsafe(48)
    challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).decode().rstrip("=")
    return verifier, challenge


def query_of(url: str) -> dict[str, str]:
    return {key: values[0] for key, values in parse_qs(urlsplit(url).query).items()}


_CSRF = re.compile(r'name="csrfmiddlewaretoken" value="([^"]+)"')


class ScriptedUser:
    """A person in a browser, over plain HTTP: signs in, reads the consent page, answers."""

    def __init__(self, base: str, username: str, password: str):
        self.base = base
        self.username, self.password = username, password
        self.http = httpx.Client(base_url=base, follow_redirects=False, timeout=30)
        self.consent_pages: list[str] = []

    def _csrf(self, path: str) -> str:
        page = self.http.get(path)
        assert page.status_code == 200, (path, page.status_code, page.text[:300])
        self.consent_pages.append(page.text)
        return _CSRF.search(page.text).group(1)

    def sign_in(self) -> None:
        token = self._csrf("/accounts/login/")
        answer = self.http.post(
            "/accounts/login/",
            data={"csrfmiddlewaretoken": token, "username": self.username, "password": self.password},
        )
        assert answer.status_code == 302, answer.text[:300]

    def authorize(self, authorize_url: str, *, grant: list[str] | None = None, deny: bool = False) -> str:
        """Follow an authorization URL to the consent page and answer it; returns the
        client redirect (with code or error) the browser would be sent to."""
        answer = self.http.get(authorize_url)
        if answer.status_code != 302 or "/oauth/consent/" not in answer.headers["location"]:
            return answer  # an error, for the caller to inspect
        consent = answer.headers["location"]
        page = self.http.get(consent)
        if page.status_code == 302:  # not signed in yet
            self.sign_in()
        token = self._csrf(consent)
        data: dict = {"csrfmiddlewaretoken": token}
        if deny:
            data["deny"] = ""
        else:
            data["allow"] = ""
            data["scope"] = grant if grant is not None else ["read", "write", "delete"]
        answer = self.http.post(consent, data=data)
        assert answer.status_code == 302, answer.text[:500]
        return answer.headers["location"]


def authorize_url(base: str, **params: str) -> str:
    return f"{base}/oauth/authorize?{urlencode(params)}"


def token_request(base: str, **form: str) -> httpx.Response:
    return httpx.post(f"{base}/oauth/token", data=form, timeout=30)


def oauth_in_process(*requests: tuple[str, str, dict]) -> list:
    """Send (method, path, httpx arguments) to the OAuth ASGI apps (oauth/provider.py)
    in-process, one after another, as http://testserver."""
    from oauth import provider

    routes = provider.oauth_asgi_routes()

    async def app(scope, receive, send):
        await routes[scope["path"]](scope, receive, send)

    async def main():
        import httpx2

        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://testserver", timeout=60) as http:
            return [await http.request(method, path, **kwargs) for method, path, kwargs in requests]

    return asyncio.run(main())
