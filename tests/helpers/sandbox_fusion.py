"""A SandboxFusion-compatible service for the tests: its POST /run_code, running each program in
novarl's local sandbox (the remote sandbox's client speaks to it as to SandboxFusion)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from novarl.rewards.sandbox import LocalSandbox, Program, SandboxLimits


class FusionService:
    """Serves on 127.0.0.1 while in a `with` block; `url` is its address, `requests` its count."""

    def __init__(self) -> None:
        service = self
        self.requests = 0

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                service.requests += 1
                sandbox = LocalSandbox(SandboxLimits(timeout_s=float(body["run_timeout"]),
                                                     memory_mb=int(body["memory_limit_MB"])))
                run = sandbox.run(Program(body["code"], stdins=(body.get("stdin") or "",))).runs[0]
                finished = run.status != "timeout"
                answer = {"status": "Success" if run.status == "ok" else "Failed", "compile_result": None,
                          "run_result": {"status": "Finished" if finished else "TimeLimitExceeded",
                                         "execution_time": run.seconds, "return_code": 0 if run.status == "ok" else 1,
                                         "stdout": run.stdout, "stderr": run.stderr}, "files": {}}
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "FusionService":
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
