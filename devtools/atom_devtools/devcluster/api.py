"""A minimal JSON client for the API server (stdlib only: the launcher must run pre-install)."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from typing import Any


class ApiClient:
    def __init__(self, server: str, token: str, ca_file: str | None) -> None:
        self.server = server.rstrip("/")
        self.token = token
        if ca_file:
            self.ssl = ssl.create_default_context(cafile=ca_file)
        else:  # only while the server's self-signed certificate is not written yet
            self.ssl = ssl._create_unverified_context()

    def request(self, method: str, path: str, body: Any = None, *, timeout: float = 10,
                content_type: str = "application/json") -> tuple[int, Any]:
        """Return (HTTP status, decoded JSON or text); HTTP errors are returned, not raised."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.server + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.token}")
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, context=self.ssl, timeout=timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as err:
            status, raw = err.code, err.read()
        text = raw.decode(errors="replace")
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    def get(self, path: str) -> tuple[int, Any]:
        return self.request("GET", path)

    def create(self, path: str, obj: dict) -> tuple[int, Any]:
        return self.request("POST", path, obj)


def probe(url: str, timeout: float = 2) -> bool:
    """True when an unauthenticated health endpoint (healthz of the controllers) answers 200."""
    try:
        ctx = ssl._create_unverified_context()  # components serve self-signed certs
        with urllib.request.urlopen(url, context=ctx, timeout=timeout) as resp:
            return resp.status == 200
    except (OSError, urllib.error.URLError):
        return False


def probe_http(url: str, timeout: float = 2) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200
    except (OSError, urllib.error.URLError):
        return False
