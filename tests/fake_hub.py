"""A stand-in for the Hugging Face Hub (which these machines cannot reach): the
few routes ``huggingface_hub.snapshot_download`` uses, served over real HTTP so
that the real client runs against it (``HF_ENDPOINT``). Like moto for S3."""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass, field

from flask import Flask, Response, jsonify, request
from werkzeug.serving import make_server

from tests.server import free_port


@dataclass
class Repo:
    files: dict[str, bytes]
    sha: str = "0123456789abcdef0123456789abcdef01234567"
    token: str | None = None         # private: this bearer token is needed
    gated: bool = False              # gated: refused (403) but to ``token``, when it is set
    seconds_per_file: float = 0.0    # how long each file's body takes to send
    downloads: list[str] = field(default_factory=list)   # files sent whole
    partial: list[str] = field(default_factory=list)     # files of which a byte range was sent


class FakeHub:
    def __init__(self, repos: dict[str, Repo]) -> None:
        self.repos = repos
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = make_server("127.0.0.1", self.port, self._app(), threaded=True)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeHub":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()

    def _repo(self, org: str, name: str, revision: str | None = None) -> Repo | Response:
        repo = self.repos.get(f"{org}/{name}")
        if repo is None:
            return _error(404, "RepoNotFound", "Repository not found")
        granted = repo.token is not None and request.headers.get("Authorization") == f"Bearer {repo.token}"
        if repo.gated and not granted:  # gated: only the token of an account granted access (Repo.token) gets in
            return _error(403, "GatedRepo", "Access to this model is restricted")
        if repo.token is not None and not granted:
            return _error(401, "RepoNotFound", "Repository not found")
        if revision not in (None, "main", repo.sha):
            return _error(404, "RevisionNotFound", "Invalid rev id")
        return repo

    def _app(self) -> Flask:
        app = Flask("fake-hub")

        @app.get("/api/models/<org>/<name>")
        @app.get("/api/models/<org>/<name>/revision/<revision>")
        def info(org, name, revision="main"):
            repo = self._repo(org, name, revision)
            if isinstance(repo, Response):
                return repo
            sizes = request.args.get("blobs", "").lower() == "true"  # model_info(files_metadata=True) asks for sizes
            return jsonify(id=f"{org}/{name}", sha=repo.sha, siblings=[
                {"rfilename": f, **({"size": len(body)} if sizes else {})} for f, body in repo.files.items()])

        @app.get("/api/models/<org>/<name>/tree/<revision>")
        def tree(org, name, revision):
            repo = self._repo(org, name, revision)
            if isinstance(repo, Response):
                return repo
            return jsonify([{"type": "file", "path": f, "size": len(body), "oid": _etag(body)}
                            for f, body in repo.files.items()])

        @app.route("/<org>/<name>/resolve/<revision>/<path:filename>", methods=["GET", "HEAD"])
        def resolve(org, name, revision, filename):
            repo = self._repo(org, name, revision)
            if isinstance(repo, Response):
                return repo
            if filename not in repo.files:
                return _error(404, "EntryNotFound", "Entry not found")
            body = repo.files[filename]
            headers = {"X-Repo-Commit": repo.sha, "ETag": f'"{_etag(body)}"'}
            if request.method == "HEAD":  # the body is dropped; its length stays in Content-Length
                return Response(body, headers=headers)
            if request.range is not None:  # huggingface_hub reads safetensors headers with a byte range
                start, stop = request.range.range_for_length(len(body))
                repo.partial.append(filename)
                response = Response(body[start:stop], status=206, headers=headers)
                response.headers["Content-Range"] = f"bytes {start}-{stop - 1}/{len(body)}"
                return response
            repo.downloads.append(filename)

            def slowly():
                pieces = 20
                step = max(1, -(-len(body) // pieces))
                for start in range(0, len(body), step):
                    time.sleep(repo.seconds_per_file / pieces)
                    yield body[start:start + step]

            return Response(slowly(), headers={**headers, "Content-Length": str(len(body))})

        return app


def _etag(body: bytes) -> str:
    return hashlib.sha1(body).hexdigest()


def _error(status: int, code: str, message: str) -> Response:
    response = jsonify(error=message)
    response.status_code = status
    response.headers["X-Error-Code"] = code
    response.headers["X-Error-Message"] = message
    return response
