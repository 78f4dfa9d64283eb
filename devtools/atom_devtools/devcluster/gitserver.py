"""A Git server on 127.0.0.1 over smart HTTP, for Flux on the local cluster: `git http-backend`
(CGI) behind a small threaded HTTP server. Flux's source-controller clones from it over http://
as from any Git host; tests and the demo push to it through `Checkout`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType

from .errors import ClusterError

BRANCH = "main"
# No user or system git config: the identity and the branch name are the ones set here.
GIT_ENV = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
           "GIT_AUTHOR_NAME": "atom", "GIT_AUTHOR_EMAIL": "atom@localhost",
           "GIT_COMMITTER_NAME": "atom", "GIT_COMMITTER_EMAIL": "atom@localhost"}


def git(*args: str, cwd: Path | None = None) -> str:
    git_bin = shutil.which("git")
    if git_bin is None:
        raise ClusterError("git not found: the local Git server runs `git http-backend`")
    proc = subprocess.run([git_bin, *args], cwd=cwd, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, **GIT_ENV))
    if proc.returncode != 0:
        raise ClusterError(f"git {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout.strip()


class _Backend(BaseHTTPRequestHandler):
    """One request through `git http-backend`: CGI environment in, CGI headers and body out."""

    server: _Server

    def do_GET(self) -> None:
        self._cgi()

    def do_POST(self) -> None:
        self._cgi()

    def log_message(self, format: str, *args: object) -> None:
        pass  # the Flux controllers' logs say what they fetched

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []  # pushes over http.postBuffer (1 MiB) come chunked
            while size := int(self.rfile.readline().split(b";")[0], 16):
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            self.rfile.readline()
            return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _cgi(self) -> None:
        path, _, query = self.path.partition("?")
        body = self._body()
        env = dict(os.environ, **GIT_ENV, GIT_PROJECT_ROOT=str(self.server.root),
                   GIT_HTTP_EXPORT_ALL="1", PATH_INFO=path, QUERY_STRING=query,
                   REQUEST_METHOD=self.command, REMOTE_ADDR=self.client_address[0],
                   CONTENT_TYPE=self.headers.get("Content-Type", ""),
                   CONTENT_LENGTH=str(len(body)))
        for header in ("Content-Encoding", "Git-Protocol"):
            if header in self.headers:
                env["HTTP_" + header.upper().replace("-", "_")] = self.headers[header]
        proc = subprocess.run(["git", "http-backend"], input=body, env=env, capture_output=True,
                              timeout=120)
        head, sep, payload = proc.stdout.partition(b"\r\n\r\n")
        if not sep:
            self.send_error(500, f"git http-backend: {proc.stderr.decode(errors='replace')}")
            return
        status, headers = 200, []
        for line in head.decode().split("\r\n"):
            key, _, value = line.partition(": ")
            if key.lower() == "status":
                status = int(value.split()[0])
            else:
                headers.append((key, value))
        self.send_response(status)
        for key, value in headers:
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root: Path) -> None:
        super().__init__(("127.0.0.1", 0), _Backend)
        self.root = root


class GitServer:
    """Bare repositories under one temporary directory, served on a free 127.0.0.1 port; a
    context manager that removes them on exit."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="atom-git-"))
        self._server = _Server(self.root)
        self._thread = threading.Thread(target=self._server.serve_forever, name="git-server",
                                        daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def url(self, repo: str) -> str:
        return f"http://127.0.0.1:{self.port}/{repo}.git"

    def create(self, repo: str) -> str:
        """A new empty bare repository that accepts pushes over HTTP; returns its URL."""
        bare = self.root / f"{repo}.git"
        git("init", "--quiet", "--bare", f"--initial-branch={BRANCH}", str(bare))
        git("config", "http.receivepack", "true", cwd=bare)  # anonymous push: local only
        return self.url(repo)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> GitServer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


class Checkout:
    """A working copy of one repository that commits and pushes to `main` over HTTP."""

    def __init__(self, url: str, path: Path) -> None:
        self.path = path
        git("clone", "--quiet", url, str(path))
        git("checkout", "--quiet", "-B", BRANCH, cwd=path)

    def commit(self, files: Mapping[str, str | None], message: str) -> str:
        """Write (text) or delete (None) each file, commit, push; returns the commit's SHA."""
        for rel, text in files.items():
            target = self.path / rel
            if text is None:
                target.unlink()
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text)
        git("add", "--all", cwd=self.path)
        git("commit", "--quiet", "-m", message, cwd=self.path)
        return self.push()

    def revert(self, sha: str) -> str:
        git("revert", "--no-edit", sha, cwd=self.path)
        return self.push()

    def push(self) -> str:
        git("push", "--quiet", "origin", f"HEAD:{BRANCH}", cwd=self.path)
        return git("rev-parse", "HEAD", cwd=self.path)
