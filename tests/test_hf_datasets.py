"""`hf://datasets/...` datasets, read through huggingface_hub's own file system (fsspec's `hf` protocol) from a
Hub served on 127.0.0.1 (`HF_ENDPOINT`): the Hugging Face Hub's routes that reading one file asks for (the
repository, its tree, the file). The real Hub is never reached from tests."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading

import pytest

from tests.helpers import txflow_cmd

SHA = "0" * 40
FILES = {
    "train.jsonl": json.dumps({"messages": [{"role": "user", "content": "2+2?"},
                                            {"role": "assistant", "content": "4"}]}) + "\n"
    + json.dumps({"prompt": "3+3?", "completion": "6"}) + "\n",
    "bad.jsonl": json.dumps({"prompt": "a", "completion": "b"}) + "\n" + json.dumps({"messages": []}) + "\n",
}


class Hub(http.server.BaseHTTPRequestHandler):
    """The routes `HfFileSystem` reads a file of dataset `org/data` through."""

    asked: list[str] = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        path = self.path.split("?")[0]
        self.asked.append(path)
        if path == "/api/datasets/org/data":
            return self._json({"id": "org/data", "sha": SHA, "siblings": [{"rfilename": f} for f in FILES]})
        if path.startswith("/api/datasets/org/data/tree/"):
            return self._json([{"type": "file", "path": f, "size": len(t.encode()), "oid": "1" * 40}
                               for f, t in FILES.items()])
        name = path.removeprefix("/datasets/org/data/resolve/main/")
        if name in FILES:
            return self._send(FILES[name].encode(), "text/plain", [("ETag", '"e"'), ("X-Repo-Commit", SHA)])
        self._send(b'{"error": "not found"}', "application/json", status=404)

    def _json(self, value):
        self._send(json.dumps(value).encode(), "application/json")

    def _send(self, body: bytes, kind: str, headers=(), status: int = 200):
        self.send_response(status)
        for key, value in [("Content-Type", kind), ("Content-Length", str(len(body))), *headers]:
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture()
def hub():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    Hub.asked = []
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


READ = """
import json, sys
from txflow.training.datasets import REQUIRED_KEYS, load_jsonl
print(json.dumps(load_jsonl(sys.argv[1], REQUIRED_KEYS["sft"], messages=True)))
"""


def test_an_hf_dataset_url_reads_the_file_from_the_hub(hub):
    # huggingface_hub reads HF_ENDPOINT when it is imported: a process of its own.
    done = subprocess.run([sys.executable, "-c", READ, "hf://datasets/org/data/train.jsonl"], capture_output=True,
                          text=True, timeout=120, env=os.environ | _env(hub))
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == [json.loads(line) for line in FILES["train.jsonl"].splitlines()]
    assert "/datasets/org/data/resolve/main/train.jsonl" in Hub.asked


def test_txflow_run_on_an_hf_dataset_with_a_bad_row_exits_2_naming_it(hub, tmp_path, txflow_env):
    url = "hf://datasets/org/data/bad.jsonl"
    done = subprocess.run(txflow_cmd("run", "sft", "--base-model", "tiny", "--run-id", "hf", "--dataset", url,
                                     "--state-dir", str(tmp_path / "state"), "--checkpoints", str(tmp_path / "ckpt")),
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=txflow_env | _env(hub))
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"{url} line 2: 'messages' must be a non-empty list" in done.stderr
    assert not (tmp_path / "state" / "cluster.json").exists()  # nothing started


def _env(hub: str) -> dict[str, str]:
    return {"HF_ENDPOINT": hub, "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_OFFLINE": "0"}
