"""[audit]: records of real requests through the proxy, the hash chain and `audit verify`,
rotation, SIGKILL under load with fsync="always", and `audit query` over drifting schemas."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from aiproxy.governance.auth import hash_key
from tests.conftest import simple_config
from tests.support import free_port, process_log, raw_exchange

KEY = "ak_audit_0123456789abcdef"
POLICY = """
[[rules]]
id = "no-delete"
effect = "deny"
methods = ["DELETE"]

[[rules]]
id = "all"
effect = "allow"
"""


def _config(upstream: int, tmp: Path, audit: str) -> str:
    (tmp / "policy.toml").write_text(POLICY)
    # One process, one writer: with workers each worker writes its own chained file.
    return "[server]\nworkers = 1\n" + simple_config(upstream) + f"""
[tracing]

[auth]
api_keys = [{{ id = "k", subject = "alice", hash = "{hash_key(KEY)}", roles = ["r"] }}]

[policy]
files = ["{tmp / 'policy.toml'}"]

[audit]
path = "{tmp / 'audit.log'}"
{audit}
"""


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiproxy", "audit", *args],
                          capture_output=True, text=True, timeout=60)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


def _wait_records(path: Path, n: int) -> list[dict]:
    deadline = time.monotonic() + 5
    while True:
        recs = _records(path) if path.exists() else []
        if len(recs) >= n or time.monotonic() > deadline:
            return recs
        time.sleep(0.05)


def test_records_and_verify_detects_tampering(start_proxy, demo_upstream, tmp_path):
    proxy = start_proxy(_config(demo_upstream, tmp_path, 'fsync = "interval"\n'
                                                         "fsync_interval_ms = 20"))
    with httpx.Client(timeout=10) as c:
        h = {"x-api-key": KEY}
        assert c.post(f"{proxy.url}/echo", headers=h, content=b"x" * 300).status_code == 200
        assert c.get(f"{proxy.url}/echo").status_code == 401
        refused = c.delete(f"{proxy.url}/echo", headers=h)
        assert refused.status_code == 403
        for i in range(5):
            assert c.get(f"{proxy.url}/bytes/{1000 + i}", headers=h).status_code == 200
    log = tmp_path / "audit.log"
    recs = _wait_records(log, 8)
    assert len(recs) == 8, recs
    ok, unauth, denied = recs[0], recs[1], recs[2]
    assert ok["identity"] == {"sub": "alice", "kind": "api_key", "roles": ["r"]}
    assert ok["decision"] == {"result": "allow", "rule": "all"}
    assert ok["status"] == 200 and ok["outcome"] == "answered" and ok["route"] == "all"
    assert ok["bytes_in"] == 300 and ok["bytes_out"] > 0 and len(ok["trace_id"]) == 32
    assert "total" in ok["timings_ms"]
    assert unauth["status"] == 401 and unauth["identity"] is None
    assert denied["status"] == 403 and denied["decision"] == {"result": "deny",
                                                              "rule": "no-delete"}
    assert denied["bytes_out"] == len(refused.content) > 0  # the proxy's JSON body
    assert [r["seq"] for r in recs] == list(range(1, 9))
    assert [r["bytes_out"] for r in recs[3:]] == [1000, 1001, 1002, 1003, 1004]

    res = _cli("verify", str(log))
    assert res.returncode == 0 and res.stdout.startswith("ok: 8 records"), res.stdout
    lines = log.read_bytes().splitlines(keepends=True)
    # Edited, removed and reordered records are each caught.
    for name, tampered in (
            ("edited", lines[:3] + [lines[3].replace(b'"status":200', b'"status":201')]
             + lines[4:]),
            ("removed", lines[:4] + lines[5:]),
            ("reordered", lines[:2] + [lines[3], lines[2]] + lines[4:])):
        bad = tmp_path / f"{name}.log"
        bad.write_bytes(b"".join(tampered))
        res = _cli("verify", str(bad))
        assert res.returncode == 1, (name, res.stdout)
        assert "prev hash does not match" in res.stdout or "expected" in res.stdout, res.stdout


def test_rotation_keeps_the_chain_across_files(start_proxy, demo_upstream, tmp_path):
    proxy = start_proxy(_config(demo_upstream, tmp_path, "rotate_bytes = 4096\n"))
    with httpx.Client(timeout=10) as c:
        for _ in range(40):
            assert c.get(f"{proxy.url}/echo", headers={"x-api-key": KEY}).status_code == 200
    log = tmp_path / "audit.log"
    deadline = time.monotonic() + 5
    while True:
        files = sorted(tmp_path.glob("audit.log*"))
        if sum(len(_records(f)) for f in files) >= 40 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(files) >= 3, files
    assert all(f.stat().st_size <= 4096 for f in files)  # rotated between records
    res = _cli("verify", *map(str, files))
    assert res.returncode == 0 and "ok: 40 records" in res.stdout, res.stdout
    rotated = [f for f in files if f != log]
    res = _cli("verify", *(str(f) for f in files if f != rotated[1]))  # a whole file removed
    assert res.returncode == 1 and "prev hash does not match" in res.stdout, res.stdout


def test_each_worker_file_is_its_own_chain(start_proxy, demo_upstream, tmp_path):
    """Worker N writes PATH.wN; `audit verify PATH.w*` checks each as a chain of its own
    (with its rotated files), as the README says to run it."""
    text = _config(demo_upstream, tmp_path, "").replace("workers = 1", "workers = 2")
    proxy = start_proxy(text)
    deadline = time.monotonic() + 20
    files: list[Path] = []
    while time.monotonic() < deadline:  # new connections until both workers took some
        for _ in range(10):
            with httpx.Client(timeout=10) as c:
                assert c.get(f"{proxy.url}/echo", headers={"x-api-key": KEY}).status_code == 200
        files = sorted(tmp_path.glob("audit.log.w*"))
        if len(files) == 2 and all(len(_records(f)) >= 2 for f in files):
            break
    assert len(files) == 2 and all(_records(f) for f in files), files
    time.sleep(0.3)  # the last records' flush
    res = _cli("verify", *map(str, files))
    assert res.returncode == 0, res.stdout
    assert [line.split(":")[0] for line in res.stdout.splitlines()] == list(map(str, files))
    # The first records of a chain removed: a problem, unless --partial says they were
    # archived on purpose.
    lines = files[0].read_bytes().splitlines(keepends=True)
    files[0].write_bytes(b"".join(lines[1:]))
    res = _cli("verify", str(files[0]))
    assert res.returncode == 1 and "chain starts at seq 2" in res.stdout, res.stdout
    assert _cli("verify", "--partial", str(files[0])).returncode == 0


def test_sigkill_under_load_loses_no_answered_record(start_proxy, demo_upstream, tmp_path):
    """fsync="always": every request whose complete response a client got has a durable
    record, whenever the process dies. Clients send their own trace ids to match them."""
    proxy = start_proxy(_config(demo_upstream, tmp_path, 'fsync = "always"\n'))
    answered: list[str] = []
    stop = threading.Event()
    lock = threading.Lock()

    def client(n: int) -> None:
        i = 0
        with httpx.Client(timeout=5) as c:
            while not stop.is_set():
                trace = f"{n:08x}{i:024x}"
                i += 1
                try:
                    path = "/echo" if i % 2 else f"/bytes/{2000 + i}"
                    r = c.get(f"{proxy.url}{path}", headers={
                        "x-api-key": KEY, "traceparent": f"00-{trace}-00f067aa0ba902b7-01"})
                    r.read()
                except httpx.HTTPError:
                    continue
                if r.status_code == 200:
                    with lock:
                        answered.append(trace)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(1, 7)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while len(answered) < 300 and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(proxy.proc.pid, signal.SIGKILL)
    proxy.proc.wait(5)
    stop.set()
    for t in threads:
        t.join()
    log = tmp_path / "audit.log"
    data = log.read_bytes()
    recorded = set()
    for line in data.split(b"\n"):
        try:
            recorded.add(json.loads(line)["trace_id"])
        except ValueError:
            pass  # an incomplete last line of a request never answered
    missing = [t for t in answered if t not in recorded]
    print(f"answered {len(answered)}, records {len(recorded)}, missing {len(missing)}")
    assert len(answered) >= 50
    assert not missing, missing[:5]
    res = _cli("verify", str(log))
    assert res.returncode == 0, res.stdout


def test_query_over_drifting_schemas(tmp_path):
    old = [  # early schema: status as a string, identity as a flat string, no tokens
        {"time": "2026-11-30T00:00:00Z", "identity": "alice", "model": "gpt-4o",
         "status": "200"},
        {"time": "2026-11-30T00:00:01Z", "identity": "bob", "model": "tiny", "status": "500"},
    ]
    new = [  # later schema: nested identity, numeric status, token counts
        {"time": "2026-11-30T01:00:00Z", "identity": {"sub": "alice"}, "model": "gpt-4o",
         "status": 200, "tokens": {"total": 30}},
        {"time": "2026-11-30T01:00:01Z", "identity": {"sub": "alice"}, "model": "tiny",
         "status": 429},
        {"time": "2026-11-30T01:00:02Z", "identity": {"sub": "carol"}, "model": "gpt-4o",
         "status": 200, "tokens": {"total": 5}},
    ]
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_text("".join(json.dumps(r) + "\n" for r in old))
    b.write_text("".join(json.dumps(r) + "\n" for r in new) + '{"time": "2026-11-3')

    def q(*args: str) -> list[dict]:
        res = _cli("query", str(a), str(b), "--format", "json", *args)
        assert res.returncode == 0, res.stderr
        return [json.loads(line) for line in res.stdout.splitlines()]

    rows = q("--where", "identity.sub=alice", "--group-by", "model")
    assert rows == [{"model": "gpt-4o", "count": 1}, {"model": "tiny", "count": 1}]
    # status is a string in a.log and a number in b.log: compared as strings throughout.
    rows = q("--where", "status=200", "--fields", "identity,identity.sub,status")
    assert rows == [{"identity": "alice", "identity.sub": None, "status": "200"},
                    {"identity": None, "identity.sub": "alice", "status": 200},
                    {"identity": None, "identity.sub": "carol", "status": 200}]
    assert len(q("--where", "status>=429")) == 2  # "500" and 429, as strings
    # tokens.total is only ever a number: a numeric comparison; missing is null.
    assert [r["identity.sub"] for r in q("--where", "tokens.total>10",
                                         "--fields", "identity.sub")] == ["alice"]
    assert len(q("--where", "tokens.total=null")) == 3
    assert len(q("--since", "2026-11-30T00:30:00Z")) == 3
    rows = q("--group-by", "identity.sub,model")
    assert {"identity.sub": None, "model": "gpt-4o", "count": 1} in rows
    assert {"identity.sub": "alice", "model": "gpt-4o", "count": 1} in rows
    res = _cli("query", str(a), str(b), "--group-by", "model")
    assert res.stdout.splitlines()[0].split() == ["model", "count"]
    assert res.stdout.splitlines()[1].split() == ["gpt-4o", "3"]
    assert _cli("query", str(a), "--where", "bogus").returncode == 2


@pytest.mark.parametrize("fsync", ["always", "never"])
def test_local_replies_and_streams_recorded(start_proxy, demo_upstream, tmp_path, fsync):
    proxy = start_proxy(_config(demo_upstream, tmp_path, f'fsync = "{fsync}"\n'),
                        'protocols = ["http1", "h2c"]')
    with httpx.Client(timeout=10, http2=True, http1=False) as c:
        r = c.get(f"{proxy.url}/sse?n=5", headers={"x-api-key": KEY})
        assert r.status_code == 200 and r.text.count("data:") >= 5
        assert c.get(f"{proxy.url}/echo").status_code == 401
    recs = _wait_records(tmp_path / "audit.log", 2)
    assert [r["status"] for r in recs] == [200, 401]
    assert recs[0]["bytes_out"] == len(r.content) or recs[0]["bytes_out"] > 0


def test_lone_surrogate_model_is_recorded(start_proxy, demo_upstream, tmp_path):
    """A JSON body's "model" may be a lone surrogate escape ("\\ud800": JSON's grammar
    takes it, UTF-8 cannot encode it). [llm] passed it as is to the audit record, the
    access log line and the /metrics labels: the audit writer thread died (no record
    after it), the access log raised out of the exchange's end (the client's keep-alive
    connection was left hanging) and /metrics answered 500 from then on (found by
    fuzzing). It is recorded as U+FFFD, as the prompt text already is."""
    admin = free_port()
    proxy = start_proxy(_config(demo_upstream, tmp_path, "")
                        + f'[llm]\n[admin]\naddress = "127.0.0.1:{admin}"\n')
    body = b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}'
    h = {"x-api-key": KEY, "content-type": "application/json"}
    with httpx.Client(timeout=10) as c:
        first = c.post(f"{proxy.url}/v1/chat/completions", headers=h, content=body)
        second = c.post(f"{proxy.url}/v1/chat/completions", headers=h,
                        content=body.replace(b"\\ud800", b"m"))
        metrics = c.get(f"http://127.0.0.1:{admin}/metrics")
    assert first.status_code == 200 and second.status_code == 200
    assert metrics.status_code == 200, metrics.text
    recs = _wait_records(tmp_path / "audit.log", 2)
    assert [r["model"] for r in recs] == ["\ufffd", "m"], recs
    assert "Traceback" not in process_log(proxy.proc)


def test_time_rotation_and_restart_continue_the_chain(tmp_path):
    """The writer by itself (a real thread and files): rotation by time, and a new
    writer (a restart) continuing the chain after dropping a torn last line."""
    import asyncio

    from aiproxy.config.governance import AuditConfig
    from aiproxy.governance.audit import AuditWriter

    path = tmp_path / "a.log"
    cfg = AuditConfig(path=str(path), fsync="always", rotate_interval_s=1)

    async def write(writer: AuditWriter, n: int) -> None:
        await asyncio.gather(*(writer.submit({"n": i}, durable=True) for i in range(n)))

    w = AuditWriter(cfg)
    asyncio.run(write(w, 5))
    time.sleep(1.3)
    asyncio.run(write(w, 5))
    w.close()
    with open(path, "ab") as fh:
        fh.write(b'{"seq": 11, "prev": "torn')  # a crash in the middle of a write
    w = AuditWriter(cfg)
    asyncio.run(write(w, 3))
    w.close()
    files = sorted(tmp_path.glob("a.log*"))
    assert len(files) >= 2, files
    res = _cli("verify", *map(str, files))
    assert res.returncode == 0 and "ok: 13 records" in res.stdout, res.stdout
    assert [r["seq"] for r in _records(path)][-3:] == [11, 12, 13]


def test_reload_keeps_one_chain(start_proxy, demo_upstream, tmp_path):
    proxy = start_proxy(_config(demo_upstream, tmp_path, 'fsync = "never"\n'))
    with httpx.Client(timeout=10) as c:
        for _ in range(3):
            assert c.get(f"{proxy.url}/echo", headers={"x-api-key": KEY}).status_code == 200
        text = proxy.config_path.read_text().replace('fsync = "never"', 'fsync = "always"')
        proxy.config_path.write_text(text)
        proxy.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "reload" not in proxy.log().lower():
            assert time.monotonic() < deadline, proxy.log()
            time.sleep(0.05)
        for _ in range(3):
            assert c.get(f"{proxy.url}/echo", headers={"x-api-key": KEY}).status_code == 200
    recs = _wait_records(tmp_path / "audit.log", 6)
    assert [r["seq"] for r in recs] == [1, 2, 3, 4, 5, 6]
    assert _cli("verify", str(tmp_path / "audit.log")).returncode == 0


def test_unrouted_replies_recorded(start_proxy, demo_upstream, tmp_path):
    """Requests no route took (404, a 400 for a malformed target, a 417) still get one
    audit record each, with their status and a trace id, in the same hash chain."""
    config = _config(demo_upstream, tmp_path, 'fsync = "always"\n').replace(
        'match = { path_prefix = "/" }', 'match = { path_prefix = "/v1/" }')
    proxy = start_proxy(config)
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    with httpx.Client(timeout=10) as c:
        r = c.get(f"{proxy.url}/nowhere",
                  headers={"traceparent": f"00-{trace}-00f067aa0ba902b7-01"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "no_route", r.text
        assert c.get(f"{proxy.url}/v1/echo", headers={"x-api-key": KEY}).status_code == 404
    for request, status in ((b"GET /v1/%zz HTTP/1.1\r\nHost: a\r\n\r\n", b"400"),
                            (b"GET /v1/a#b HTTP/1.1\r\nHost: a\r\n\r\n", b"400"),
                            (b"POST /v1/echo HTTP/1.1\r\nHost: a\r\nExpect: fly\r\n"
                             b"Content-Length: 1\r\n\r\nx", b"417")):
        head = raw_exchange(proxy.port, request, until=b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 " + status + b" "), head
    log = tmp_path / "audit.log"
    recs = _wait_records(log, 5)
    assert [r["status"] for r in recs] == [404, 404, 400, 400, 417], recs
    assert recs[0]["trace_id"] == trace and recs[0]["route"] is None
    assert recs[0]["path"] == "/nowhere" and recs[0]["outcome"] == "answered"
    assert all(len(r["trace_id"]) == 32 and r["span_id"] for r in recs)
    assert len({r["trace_id"] for r in recs}) == 5
    res = _cli("verify", str(log))
    assert res.returncode == 0 and res.stdout.startswith("ok: 5 records"), res.stdout


def test_a_failed_write_leaves_no_torn_record_and_a_chain_that_verifies(
        start_proxy, demo_upstream, tmp_path):
    """A write that fails part way (a full disk; here the process's file size limit,
    set with prlimit) used to leave half a record in the file, and the chain went on
    from the records that never got in: the next record was glued to the torn one and
    `audit verify` reported tampering. The failed records' requests are not answered
    (fsync = "always"); once the disk has room again the chain goes on and verifies,
    with one record per answered request."""
    proxy = start_proxy(_config(demo_upstream, tmp_path, 'fsync = "always"\n'))
    pid = str(proxy.proc.pid)

    def get() -> bool:
        try:
            with httpx.Client(timeout=10) as c:
                return c.get(f"{proxy.url}/echo", headers={"x-api-key": KEY}).status_code == 200
        except httpx.HTTPError:  # the response is cut short: its record was not written
            return False

    subprocess.run(["prlimit", "--pid", pid, "--fsize=2500:"], check=True)  # soft limit
    answered = [get() for _ in range(8)]
    assert answered[0] and not answered[-1], answered  # records of ~600 bytes: full at 4
    subprocess.run(["prlimit", "--pid", pid, "--fsize=unlimited:"], check=True)
    answered += [get() for _ in range(3)]
    assert answered[-3:] == [True] * 3
    log = tmp_path / "audit.log"
    assert log.read_bytes().endswith(b"\n")
    recs = _records(log)  # every line a whole record
    assert len(recs) == sum(answered), (answered, recs)
    res = _cli("verify", str(log))
    assert res.returncode == 0 and f"ok: {sum(answered)} records" in res.stdout, res.stdout
    assert "audit write failed: [Errno 27] File too large" in proxy.log()


def test_verify_against_an_anchored_head_catches_a_truncated_log(start_proxy, demo_upstream,
                                                                 tmp_path):
    """Records cut off the end leave a chain that is whole: only a head hash kept
    elsewhere tells. `audit verify --anchor HASH` (a head printed by an earlier verify)
    fails unless that record is still in the chain."""
    proxy = start_proxy(_config(demo_upstream, tmp_path, 'fsync = "always"\n'))
    log = tmp_path / "audit.log"

    def requests(n: int) -> None:
        with httpx.Client(timeout=10) as c:
            for _ in range(n):
                assert c.get(f"{proxy.url}/echo", headers={"x-api-key": KEY}).status_code == 200

    requests(3)
    res = _cli("verify", str(log))
    assert res.returncode == 0 and "ok: 3 records" in res.stdout, res.stdout
    anchor = res.stdout.rsplit("head ", 1)[1].strip()
    requests(3)
    res = _cli("verify", "--anchor", anchor, str(log))
    assert res.returncode == 0 and "ok: 6 records" in res.stdout, res.stdout
    lines = log.read_bytes().splitlines(keepends=True)
    cut = tmp_path / "cut.log"
    cut.write_bytes(b"".join(lines[:2]))  # whole records removed from the end
    assert _cli("verify", str(cut)).returncode == 0  # nothing to see without the anchor
    res = _cli("verify", "--anchor", anchor, str(cut))
    assert res.returncode == 1 and f"anchor {anchor} not found" in res.stdout, res.stdout
    res = _cli("verify", "--anchor", "nothex", str(log))
    assert res.returncode == 2 and "anchor" in res.stderr, (res.stdout, res.stderr)


def test_sigusr1_after_logrotate_moves_each_worker_to_a_new_file(start_proxy, demo_upstream,
                                                                 tmp_path):
    """logrotate renames the file and sends SIGUSR1 (postrotate), as for nginx's logs and
    the access log: each worker goes on in a new PATH.wN, and `audit verify` follows each
    chain from the renamed file into the new one. The writers used to keep appending to
    the renamed files and never started new ones."""
    text = _config(demo_upstream, tmp_path, 'fsync = "always"\n').replace(
        "workers = 1", "workers = 2")
    proxy = start_proxy(text)
    live = [tmp_path / "audit.log.w0", tmp_path / "audit.log.w1"]
    sent = 0

    def until_each_has_records(files: list[Path]) -> None:
        nonlocal sent
        deadline = time.monotonic() + 20
        while not all(f.exists() and _records(f) for f in files):
            assert time.monotonic() < deadline, [f.exists() and len(_records(f)) for f in files]
            with httpx.Client(timeout=10) as c:  # a new connection: either worker takes it
                assert c.get(f"{proxy.url}/echo", headers={"x-api-key": KEY}).status_code == 200
            sent += 1

    until_each_has_records(live)
    rotated = [f.with_name(f.name + ".1") for f in live]
    for f, to in zip(live, rotated, strict=True):
        f.rename(to)
    before = [len(_records(f)) for f in rotated]  # fsync = "always": all are in
    proxy.proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while not all(f.exists() for f in live):
        assert time.monotonic() < deadline, "the audit files were never reopened"
        time.sleep(0.05)
    until_each_has_records(live)
    assert [len(_records(f)) for f in rotated] == before
    assert sum(len(_records(f)) for f in live + rotated) == sent
    for old, new in zip(rotated, live, strict=True):
        assert _records(new)[0]["seq"] == _records(old)[-1]["seq"] + 1
    res = _cli("verify", *map(str, rotated + live))
    assert res.returncode == 0, res.stdout
    assert sorted(line.split(": ")[0] for line in res.stdout.splitlines()) == list(map(str, live))
    assert all("in 2 file(s)" in line for line in res.stdout.splitlines()), res.stdout


def test_logrotate_before_its_signal_and_across_a_restart(tmp_path):
    """The writer by itself, with logrotate's names: PATH renamed before SIGUSR1 arrives,
    met by a size rotation (renaming a PATH that is gone used to leave the writer on a
    closed descriptor: every later record failed, or went to whatever reused it); and a
    restart after logrotate created an empty PATH, which must go on from the chain's
    head in the renamed file, not from an older rotated one. `audit verify` follows the
    chain across PATH.N, PATH-YYYYmmdd and the stamped files alike."""
    import asyncio

    from aiproxy.config.governance import AuditConfig
    from aiproxy.governance.audit import AuditWriter

    path = tmp_path / "a.log"
    cfg = AuditConfig(path=str(path), fsync="always", rotate_bytes=4096)

    async def write(writer: AuditWriter, n: int) -> None:
        for i in range(n):  # one at a time: each batch checks for a due rotation
            await writer.submit({"n": i, "pad": "x" * 100}, durable=True)

    w = AuditWriter(cfg)
    asyncio.run(write(w, 60))  # ~9 KB: rotated to a stamped file on the way
    path.rename(tmp_path / "a.log.1")  # logrotate; its SIGUSR1 not there yet
    asyncio.run(write(w, 60))
    assert w.failed is None, w.failed
    w.close()
    path.rename(tmp_path / "a.log-20261203")  # logrotate dateext and `create`: empty PATH
    path.touch()
    w = AuditWriter(cfg)
    asyncio.run(write(w, 3))
    w.close()
    assert w.failed is None, w.failed
    files = sorted(tmp_path.glob("a.log*"))
    res = _cli("verify", *map(str, files))
    assert res.returncode == 0 and "ok: 123 records" in res.stdout, res.stdout
    assert [r["seq"] for r in _records(path)] == [121, 122, 123]


def test_a_failed_audit_reopen_keeps_the_old_file(tmp_path):
    """SIGUSR1 when PATH cannot be opened (a directory took its place) keeps appending to
    the old file, as the access log and nginx do; the next one that can open it moves on,
    and the chain runs across both."""
    import asyncio

    from aiproxy.config.governance import AuditConfig
    from aiproxy.governance.audit import AuditWriter

    path = tmp_path / "a.log"
    rotated = tmp_path / "a.log.1"
    w = AuditWriter(AuditConfig(path=str(path), fsync="always"))

    async def write(n: int) -> None:
        for i in range(n):
            await w.submit({"n": i}, durable=True)

    asyncio.run(write(2))
    path.rename(rotated)
    path.mkdir()
    w.reopen()
    asyncio.run(write(2))
    assert len(_records(rotated)) == 4 and w.failed is None
    path.rmdir()
    w.reopen()
    asyncio.run(write(2))
    w.close()
    assert len(_records(rotated)) == 4 and len(_records(path)) == 2
    res = _cli("verify", str(rotated), str(path))
    assert res.returncode == 0 and "ok: 6 records in 2 file(s)" in res.stdout, res.stdout


FAILED_ROTATION = r"""
import asyncio, os, resource, sys
from aiproxy.config.governance import AuditConfig
from aiproxy.governance.audit import AuditWriter

w = AuditWriter(AuditConfig(path=sys.argv[1], fsync="always", rotate_bytes=4096))

async def main():
    for i in range(20):
        await w.submit({"n": i, "pad": "x" * 200}, durable=True)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(map(int, os.listdir("/proc/self/fd"))) + 1, hard))
    filler = []
    while True:  # every descriptor taken: the rotation cannot open the new file
        try:
            filler.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            break
    try:
        await w.submit({"n": "lost", "pad": "x" * 4096}, durable=True)  # rotates first
        print("the record was acknowledged")
    except OSError as exc:
        print("refused:", exc)
    for fd in filler:
        os.close(fd)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    await w.submit({"n": "after"}, durable=True)

asyncio.run(main())
w.close()
print("done", w.failed)
"""


def test_a_failed_rotation_refuses_its_records_and_the_chain_goes_on(tmp_path):
    """A rotation that fails (here: no file descriptor left for the new file) fails the
    records waiting on it, so their responses are refused (fsync = "always"). They used
    to wait forever: their futures were never settled. The writer keeps the old file
    (under PATH again), and the chain goes on from the last record written."""
    path = tmp_path / "a.log"
    res = subprocess.run([sys.executable, "-c", FAILED_ROTATION, str(path)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "refused: [Errno 24] Too many open files" in res.stdout, res.stdout
    assert res.stdout.rstrip().endswith("done None"), res.stdout
    files = sorted(tmp_path.glob("a.log*"))
    res = _cli("verify", *map(str, files))
    assert res.returncode == 0 and "ok: 21 records" in res.stdout, res.stdout
    assert _records(path)[-1]["n"] == "after"


def test_writer_keeps_a_record_utf8_cannot_encode(tmp_path):
    """A lone surrogate in any field ("\\ud800" in a client's JSON) went to
    str.encode() and raised out of the writer thread: that record and every later one
    were lost. It is written as the JSON escape it came as; the chain verifies."""
    import asyncio

    from aiproxy.config.governance import AuditConfig
    from aiproxy.governance.audit import AuditWriter

    path = tmp_path / "a.log"
    w = AuditWriter(AuditConfig(path=str(path), fsync="always"))

    async def write() -> None:
        for record in ({"prompt": "x\ud800y"}, {"prompt": "after"}):
            await asyncio.wait_for(w.submit(record, durable=True), 10)

    try:
        asyncio.run(write())
    finally:
        w.close()
    assert [r["prompt"] for r in _records(path)] == ["x\ud800y", "after"]
    res = _cli("verify", str(path))
    assert res.returncode == 0 and "ok: 2 records" in res.stdout, res.stdout


def test_writer_keeps_a_record_json_cannot_encode(tmp_path):
    """A record json.dumps refuses (a key that is not a string, a cycle) raised a
    TypeError/ValueError out of the writer thread, which only caught OSError: that
    record's durable response and every later one waited forever. It is written as an
    `unencodable` record in its place in the chain, and the writer goes on."""
    import asyncio

    from aiproxy.config.governance import AuditConfig
    from aiproxy.governance.audit import AuditWriter

    path = tmp_path / "a.log"
    w = AuditWriter(AuditConfig(path=str(path), fsync="always"))
    cycle: dict = {}
    cycle["self"] = cycle

    async def write() -> None:
        for record in ({"n": "before"}, {"n": "tuple key", (1, 2): "x"},
                       {"n": "cycle", "c": cycle}, {"n": "after"}):
            await asyncio.wait_for(w.submit(record, durable=True), 10)

    try:
        asyncio.run(write())
    finally:
        w.close()
    records = _records(path)
    assert [r.get("n") for r in records] == ["before", None, None, "after"]
    assert records[1]["unencodable"].startswith("TypeError") and "(1, 2)" in records[1]["keys"]
    assert records[2]["unencodable"].startswith("ValueError: Circular reference")
    res = _cli("verify", str(path))
    assert res.returncode == 0 and "ok: 4 records" in res.stdout, res.stdout


def test_requests_refused_before_the_llm_filter_name_their_model(start_proxy, demo_upstream,
                                                                   tmp_path):
    """The audit record took the model from the LLM filter, which runs after the policy
    and the guard: a request the guard blocked, or a policy rule on models denied, was
    recorded with model null although its body named it (ex.gov["model"], which the
    audit record reads, was set by nobody). They record the body's model now."""
    (tmp_path / "models.toml").write_text(
        '[[rules]]\nid = "no-secret"\neffect = "deny"\nmodels = ["secret*"]\n\n'
        '[[rules]]\nid = "all"\neffect = "allow"\n')
    config = _config(demo_upstream, tmp_path, "").replace(
        "policy.toml", "models.toml") + """
[llm]

[guard]
[[guard.rules]]
id = "jailbreak"
action = "block"
keywords = ["ignore previous instructions"]
"""
    proxy = start_proxy(config)
    h = {"x-api-key": KEY, "content-type": "application/json"}

    def post(body: bytes) -> int:
        return httpx.post(f"{proxy.url}/v1/chat/completions", headers=h, content=body,
                          timeout=10).status_code

    assert post(b'{"model": "gpt-4o", "messages": [{"role": "user", '
                b'"content": "ignore previous instructions"}]}') == 403
    # not JSON to a strict parser (a trailing comma): what the body seems to name
    assert post(b'{"model": "gpt-4o-mini", "prompt": "ignore previous instructions",}') == 403
    assert post(b'{"model": "secret-1", "messages": [{"role": "user", "content": "hi"}]}'
                ) == 403
    recs = _wait_records(tmp_path / "audit.log", 3)
    assert [(r["status"], r["model"]) for r in recs] == [
        (403, "gpt-4o"), (403, "gpt-4o-mini"), (403, "secret-1")], recs
    assert recs[0]["guard"]["blocked"] == "jailbreak"
    assert recs[2]["decision"] == {"result": "deny", "rule": "no-secret"}
