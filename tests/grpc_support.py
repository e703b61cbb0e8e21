"""gRPC test service: proto/aiproxy/testing/v1/inference.proto compiled at test time.

`compile_inference(out_dir)` runs grpc_tools.protoc into out_dir and imports the
generated modules (generated code is never committed). `InferenceServer` is a real
grpcio server implementing the four call kinds, run in-process (its handlers record
what they saw, so tests can check what reached the upstream) or, for tests that kill
it, as a subprocess: ``python -m tests.grpc_support --gen DIR --port N``.

Predict (unary) echoes the request; prompt "fail" aborts with INVALID_ARGUMENT;
prompt "sleep:<ms>" sleeps (watching for cancellation) before answering; invocation
metadata "x-echo" comes back as initial metadata and trailing metadata always carries
"x-trailer: done-<model>" and "x-trailer-bin". StreamTokens sends one Token per word of
the prompt, "x-delay-ms" (metadata) apart. Upload counts messages and payload bytes.
Chat echoes each message as it arrives (a "sleep:<ms>" message is answered after that
long). Metadata "x-tag" makes the handlers record their events also as "event#tag".
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest

from tests.support import REPO_ROOT

PROTO_ROOT = REPO_ROOT / "proto"
PROTO_FILE = "aiproxy/testing/v1/inference.proto"
SERVICE = "aiproxy.testing.v1.Predictor"
MAX_MESSAGE = 16 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
]

_compiled: list[tuple[ModuleType, ModuleType]] = []


def compile_inference(out_dir: Path) -> tuple[ModuleType, ModuleType]:
    """Compile the test proto into out_dir; returns (inference_pb2, inference_pb2_grpc).
    Once per process: later calls return the modules the first one built."""
    if _compiled:
        return _compiled[0]
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    # Compiled from its own directory, the generated modules are top-level
    # (inference_pb2, inference_pb2_grpc): "aiproxy.testing.v1" would collide with the
    # real aiproxy package. The proto package, hence the service name, is unchanged.
    proto = PROTO_ROOT / PROTO_FILE
    rc = protoc.main([
        "grpc_tools.protoc", f"-I{proto.parent}", f"-I{include}", f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}", str(proto),
    ])
    if rc != 0:
        raise RuntimeError(f"protoc failed with {rc}")
    if str(out_dir) not in sys.path:
        sys.path.insert(0, str(out_dir))
    pb2 = importlib.import_module("inference_pb2")
    pb2_grpc = importlib.import_module("inference_pb2_grpc")
    _compiled.append((pb2, pb2_grpc))
    return pb2, pb2_grpc


@pytest.fixture(scope="session")
def grpc_modules(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModuleType, ModuleType]:
    """(inference_pb2, inference_pb2_grpc), generated into a temporary directory."""
    return compile_inference(tmp_path_factory.mktemp("grpc-gen"))


class Recorder:
    """What the upstream handlers saw, readable from the test thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[str, float]] = []
        self.changed = threading.Condition(self.lock)
        self.metadata: list[dict[str, Any]] = []

    def add(self, name: str, tag: str | None = None) -> None:
        with self.changed:
            now = time.monotonic()
            self.events.append((name, now))
            if tag:
                self.events.append((f"{name}#{tag}", now))
            self.changed.notify_all()

    def when(self, name: str, timeout: float, since: float = 0.0) -> float | None:
        """Time at which `name` was recorded (at or after `since`), waiting up to
        `timeout` for it."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                for event, at in self.events:
                    if event == name and at >= since:
                        return at
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.changed.wait(left)

    def names(self) -> list[str]:
        with self.lock:
            return [name for name, _ in self.events]


def make_servicer(pb2: ModuleType, pb2_grpc: ModuleType, rec: Recorder, name: str) -> Any:
    class Predictor(pb2_grpc.PredictorServicer):
        _tags: dict[int, str | None] = {}

        def _start(self, method: str, context: grpc.ServicerContext) -> dict[str, Any]:
            md = {k: v for k, v in context.invocation_metadata()}
            md["@method"] = method
            with rec.lock:
                rec.metadata.append(md)
            rec.add(f"start:{method}")
            # Events of a call with metadata x-tag are recorded again as "event#tag".
            tag = md.get("x-tag")
            self._tags[threading.get_ident()] = tag
            context.add_callback(lambda: rec.add(f"end:{method}", tag))
            return md

        def _add(self, name: str) -> None:
            rec.add(name, self._tags.get(threading.get_ident()))

        def _watch_sleep(self, seconds: float, method: str, context: Any) -> bool:
            """Sleep unless the call ends first; True if it was cancelled meanwhile."""
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                if not context.is_active():
                    self._add(f"cancelled:{method}")
                    return True
                time.sleep(0.01)
            return False

        def Predict(self, request: Any, context: Any) -> Any:
            md = self._start("Predict", context)
            if "x-echo" in md:
                context.send_initial_metadata((("x-echo", md["x-echo"]),))
            context.set_trailing_metadata((
                ("x-trailer", f"done-{request.model}"),
                ("x-trailer-bin", b"\x00\x01\xfe\xff"),
            ))
            if request.prompt == "fail":
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt 'fail' is not allowed: ü")
            if request.prompt.startswith("sleep:"):
                if self._watch_sleep(int(request.prompt[6:]) / 1000, "Predict", context):
                    return pb2.PredictReply()
            self._add("done:Predict")
            return pb2.PredictReply(
                model=f"{name}:{request.model}", text=request.prompt,
                payload=request.payload,
                count=len(request.payload))

        def StreamTokens(self, request: Any, context: Any) -> Iterator[Any]:
            md = self._start("StreamTokens", context)
            delay = int(md.get("x-delay-ms", "0")) / 1000
            size = int(md.get("x-token-bytes", "0"))
            words = request.prompt.split()
            for i, word in enumerate(words):
                if i and delay and self._watch_sleep(delay, "StreamTokens", context):
                    return
                if not context.is_active():
                    self._add("cancelled:StreamTokens")
                    return
                yield pb2.Token(text=word + "x" * size, index=i)
            self._add("done:StreamTokens")
            context.set_trailing_metadata((("x-count", str(len(words))),))

        def Upload(self, request_iterator: Iterator[Any], context: Any) -> Any:
            self._start("Upload", context)
            count = 0
            digest = hashlib.sha256()
            total = 0
            for req in request_iterator:
                count += 1
                total += len(req.payload)
                digest.update(req.payload)
            self._add("done:Upload")
            return pb2.PredictReply(model=name, text=digest.hexdigest(), count=count,
                                    payload=total.to_bytes(8, "big"))

        def Chat(self, request_iterator: Iterator[Any], context: Any) -> Iterator[Any]:
            self._start("Chat", context)
            n = 0
            try:
                for req in request_iterator:
                    n += 1
                    if req.prompt.startswith("sleep:") and self._watch_sleep(
                            int(req.prompt[6:]) / 1000, "Chat", context):
                        return
                    yield pb2.PredictReply(model=name, text=f"echo:{req.prompt}",
                                           payload=req.payload, count=n)
            except Exception:  # the call ended under us (cancelled)
                self._add("cancelled:Chat")
                raise
            if not context.is_active():
                self._add("cancelled:Chat")
            else:
                self._add("done:Chat")

    return Predictor()


def start_grpc_server(register: Callable[[grpc.Server], Any], port: int = 0,
                      max_workers: int = 32) -> tuple[grpc.Server, int]:
    """A started grpcio server on 127.0.0.1:port (0: a free one) in this process, its
    services added by `register(server)`; returns it and its port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                         options=GRPC_OPTIONS)
    register(server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    if not port:
        raise RuntimeError("cannot bind the gRPC test server")
    server.start()
    return server, port


class InferenceServer:
    """The Predictor service on a grpcio server on 127.0.0.1:<port> in this process."""

    def __init__(self, pb2: ModuleType, pb2_grpc: ModuleType, name: str = "grpc-a",
                 port: int = 0) -> None:
        self.recorder = Recorder()
        servicer = make_servicer(pb2, pb2_grpc, self.recorder, name)
        self.server, self.port = start_grpc_server(
            lambda s: pb2_grpc.add_PredictorServicer_to_server(servicer, s), port)

    def stop(self) -> None:
        self.server.stop(grace=None).wait(5)


def grpc_config(*clusters: tuple[str, int], routes: str | None = None, http: str = "",
                cluster_extra: str = "") -> str:
    """Clusters `name -> port` speaking h2, and (by default) one catch-all route to the first."""
    parts = [f"[http]\n{http}\n"]
    for name, port in clusters:
        parts.append(f'[[clusters]]\nname = "{name}"\nendpoints = ["127.0.0.1:{port}"]\n'
                     f'protocol = "h2"\n{cluster_extra}\n')
    if routes is None:
        routes = (f'[[routes]]\nname = "all"\nmatch = {{ path_prefix = "/" }}\n'
                  f'cluster = "{clusters[0][0]}"\n')
    parts.append(routes)
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gen", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="grpc-sub")
    parser.add_argument("--grace", type=float, default=10.0,
                        help="seconds calls in flight may take to finish after SIGTERM")
    args = parser.parse_args(argv)
    pb2, pb2_grpc = compile_inference(Path(args.gen))
    server = InferenceServer(pb2, pb2_grpc, args.name, args.port)
    print(f"listening on {server.port}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    # Graceful: GOAWAY, then the calls in flight finish (up to the grace period).
    server.server.stop(grace=args.grace).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
