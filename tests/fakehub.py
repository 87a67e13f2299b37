"""A local HTTP server speaking the Hugging Face Hub API routes that `huggingface_hub`'s
create_repo + upload_folder use (the Hub itself is unreachable from the test machines)."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import yaml

TOKEN = "hf_distillTestToken0123456789abcdef"


class FakeHub:
    """The Hub API routes create_repo + upload_folder call, over real HTTP: create, preupload, commit, revision."""

    def __init__(self):
        self.requests: list[tuple[str, str, str]] = []  # (method, path, authorization header)
        self.created: list[dict] = []
        self.commits: list[dict] = []
        self.files: dict[str, bytes] = {}
        self.validated: list[dict] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _json(self, status, obj):
                body = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def do_POST(self):
                path = self.path.split("?")[0]
                hub.requests.append(("POST", path, self.headers.get("Authorization", "")))
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return self._json(401, {"error": "Invalid credentials"})
                body = self._body()
                if path == "/api/repos/create":
                    hub.created.append(json.loads(body))
                    req = hub.created[-1]
                    return self._json(200, {"url": f"{hub.url}/datasets/{req['organization']}/{req['name']}"})
                if path == "/api/validate-yaml":  # upload_folder checks a README's metadata before committing it
                    req = json.loads(body)
                    hub.validated.append(req)
                    header = yaml.safe_load(req["content"].split("---")[1])
                    missing = [k for k in ("license", "configs", "task_categories", "size_categories") if k not in header]
                    if req["repoType"] != "dataset" or missing:
                        return self._json(400, {"errors": [{"message": f"missing {missing}"}]})
                    return self._json(200, {"warnings": []})
                if "/preupload/" in path:
                    files = json.loads(body)["files"]
                    return self._json(200, {"files": [
                        {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                         "oid": hub.git_oid(hub.files[f["path"]]) if f["path"] in hub.files else None} for f in files]})
                if "/commit/" in path:
                    lines = [json.loads(line) for line in body.splitlines() if line.strip()]
                    header = next(x["value"] for x in lines if x["key"] == "header")
                    added = {}
                    for x in lines:
                        if x["key"] == "file":
                            assert x["value"]["encoding"] == "base64"
                            added[x["value"]["path"]] = base64.b64decode(x["value"]["content"])
                    hub.files.update(added)
                    oid = hashlib.sha1(f"commit{len(hub.commits)}".encode()).hexdigest()
                    hub.commits.append({"path": path, "summary": header["summary"], "files": sorted(added), "oid": oid})
                    repo = path.split("/api/datasets/")[1].split("/commit/")[0]
                    return self._json(200, {"commitUrl": f"{hub.url}/datasets/{repo}/commit/{oid}", "commitOid": oid,
                                            "success": True})
                return self._json(404, {"error": f"no route {path}"})

            def do_GET(self):
                path = self.path.split("?")[0]
                hub.requests.append(("GET", path, self.headers.get("Authorization", "")))
                if "/revision/" in path:
                    repo = path.split("/api/datasets/")[1].split("/revision/")[0]
                    sha = hub.commits[-1]["oid"] if hub.commits else "0" * 40
                    return self._json(200, {"id": repo, "sha": sha, "private": False,
                                            "siblings": [{"rfilename": f} for f in sorted(hub.files)]})
                return self._json(404, {"error": f"no route {path}"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @staticmethod
    def git_oid(data: bytes) -> str:
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
