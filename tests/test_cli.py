"""The command line: `python -m aiproxy` as a real process (version, help, check, run)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import aiproxy
from tests.conftest import simple_config
from tests.support import REPO_ROOT, aiproxy_cli, free_port, start_process, stop_process

pytestmark = pytest.mark.timeout(60)

EXAMPLE_CONFIG = REPO_ROOT / "config" / "aiproxy.toml"


def line_of(text: str, needle: str, occurrence: int = 1) -> int:
    """1-based line of the `occurrence`-th line containing needle."""
    hits = [n for n, line in enumerate(text.splitlines(), 1) if needle in line]
    assert len(hits) >= occurrence, f"{needle!r} not in config"
    return hits[occurrence - 1]


def write(tmp_path: Path, text: str, name: str = "aiproxy.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def valid_config(port: int = 8080) -> str:
    return f"""\
# test config
[http]
max_body_bytes = 4096

[[listeners]]
name = "public"
address = "127.0.0.1:{port}"

[[clusters]]
name = "backend"
endpoints = ["127.0.0.1:9000", "127.0.0.1:9001"]

[[routes]]
name = "api"
match = {{ path_prefix = "/v1/", method = "POST" }}
cluster = "backend"

[[routes]]
name = "fallback"
cluster = "backend"
"""


# -- version and help ----------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(flag: str) -> None:
    res = aiproxy_cli(flag)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"aiproxy {aiproxy.__version__}"


def test_top_level_help_lists_commands() -> None:
    res = aiproxy_cli("--help")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("usage: aiproxy")
    for command in ("run", "check", "demo-upstream"):
        assert re.search(rf"^\s+{command}\b", res.stdout, re.M), res.stdout


def test_no_command_prints_help_and_fails() -> None:
    res = aiproxy_cli()
    assert res.returncode == 2
    assert "usage: aiproxy" in res.stdout + res.stderr


@pytest.mark.parametrize(
    "command,options",
    [("run", ("-c FILE", "--config FILE", "--log-level")),
     ("check", ("-c FILE", "--config FILE")),
     ("demo-upstream", ("--listen", "--name", "--token-delay-ms")),
     ("audit query", ("--where", "--group-by", "--since", "--fields", "JSON Lines"))],
)
def test_subcommand_help(command: str, options: tuple[str, ...]) -> None:
    res = aiproxy_cli(*command.split(), "--help")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"usage: aiproxy {command}"), res.stdout
    for option in options:
        assert option in res.stdout, res.stdout


@pytest.mark.parametrize("argv", [("chek", "-c", str(EXAMPLE_CONFIG)), ("stauts",)])
def test_unknown_command_is_named(argv: tuple[str, ...]) -> None:
    """A mistyped command was taken for `run`'s argument: `aiproxy stauts` said
    `-c/--config` is required and `aiproxy chek -c F` "unrecognized arguments". Only an
    option (`aiproxy -c F`) means `run`; a word that is no command is named as such."""
    res = aiproxy_cli(*argv)
    assert res.returncode == 2, res
    assert res.stdout == ""
    assert (f"aiproxy: error: argument COMMAND: invalid choice: '{argv[0]}' (choose from "
            in res.stderr), res.stderr
    assert "'check'" in res.stderr and "'router'" in res.stderr, res.stderr


@pytest.mark.parametrize("command", ["run", "check"])
def test_config_option_is_required(command: str) -> None:
    res = aiproxy_cli(command)
    assert res.returncode == 2
    assert "-c/--config" in res.stderr


# -- check: valid configs ------------------------------------------------------------------


def test_check_valid_config(tmp_path: Path) -> None:
    path = write(tmp_path, valid_config())
    res = aiproxy_cli("check", "-c", str(path))
    assert res.returncode == 0, res.stderr
    out = res.stdout.splitlines()
    assert "listener public 127.0.0.1:8080 [http1]" in out
    assert "cluster backend [127.0.0.1:9000, 127.0.0.1:9001] round_robin" in out
    assert "route api path_prefix=/v1/ method=POST -> backend" in out
    assert any(line.startswith("route fallback") and line.endswith("-> backend") for line in out)
    assert out[-1] == f"{path}: ok"
    assert res.stderr == ""


def test_output_to_a_closed_pipe_is_no_traceback(tmp_path: Path) -> None:
    """`aiproxy check -c F | head -0`: the reader is gone before the summary is written."""
    path = write(tmp_path, valid_config())
    proc = subprocess.Popen([sys.executable, "-m", "aiproxy", "check", "-c", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_check_long_option(tmp_path: Path) -> None:
    path = write(tmp_path, valid_config())
    res = aiproxy_cli("check", "--config", str(path))
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[-1] == f"{path}: ok"


@pytest.mark.skipif(not EXAMPLE_CONFIG.exists(), reason="no bundled config/aiproxy.toml")
def test_bundled_example_config_passes_check() -> None:
    res = aiproxy_cli("check", "-c", str(EXAMPLE_CONFIG))
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[-1] == f"{EXAMPLE_CONFIG}: ok"
    assert any(line.startswith("route ") for line in res.stdout.splitlines()), res.stdout


# -- check: configs with errors ------------------------------------------------------------

PROBLEM = re.compile(r"^(?P<file>.+?):(?P<line>\d+): (?:(?P<path>[^:\s]+): )?(?P<message>.+)$")


def problems(stderr: str) -> list[tuple[str, int, str | None, str]]:
    out = []
    for line in stderr.splitlines():
        m = PROBLEM.match(line)
        assert m, f"not FILE:LINE: key.path: message: {line!r}"
        out.append((m["file"], int(m["line"]), m["path"], m["message"]))
    return out


def check_fails(path: Path) -> list[tuple[str, int, str | None, str]]:
    res = aiproxy_cli("check", "-c", str(path))
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert "ok" not in res.stdout
    found = problems(res.stderr)
    assert found, res.stderr
    assert all(f == str(path) for f, *_ in found), found
    return found


def test_unknown_key_in_route_block(tmp_path: Path) -> None:
    text = valid_config() + 'colour = "blue"\n'  # lands in the last [[routes]] block
    path = write(tmp_path, text)
    [(_, line, key, message)] = check_fails(path)
    assert line == line_of(text, "colour")
    assert key == "routes[1].colour"
    assert "unknown key 'colour'" in message


def test_unknown_key_in_first_route_block(tmp_path: Path) -> None:
    text = valid_config().replace('name = "api"\n', 'name = "api"\nclustr = "backend"\n')
    path = write(tmp_path, text)
    [(_, line, key, message)] = check_fails(path)
    assert (line, key) == (line_of(text, "clustr"), "routes[0].clustr")
    assert "did you mean 'cluster'" in message


def test_route_with_unknown_cluster(tmp_path: Path) -> None:
    text = valid_config().replace('name = "fallback"\ncluster = "backend"',
                                  'name = "fallback"\ncluster = "nowhere"')
    path = write(tmp_path, text)
    [(_, line, key, message)] = check_fails(path)
    assert (line, key) == (line_of(text, 'cluster = "nowhere"'), "routes[1].cluster")
    assert "unknown cluster 'nowhere'" in message
    assert "backend" in message  # names the defined clusters


@pytest.mark.parametrize(
    "address,reason",
    [("127.0.0.1", "expected host:port"), ("127.0.0.1:0", "port must be between"),
     ("127.0.0.1:99999", "port must be between"), ("bad host:80", "expected host:port"),
     ("[::1:80", "expected host:port")],
)
def test_bad_endpoint_address(tmp_path: Path, address: str, reason: str) -> None:
    text = valid_config().replace(
        'endpoints = ["127.0.0.1:9000", "127.0.0.1:9001"]',
        f'endpoints = [\n  "127.0.0.1:9000",\n  "{address}",\n]')
    path = write(tmp_path, text)
    [(_, line, key, message)] = check_fails(path)
    assert (line, key) == (line_of(text, f'"{address}"'), "clusters[0].endpoints[1]")
    assert f"invalid address '{address}'" in message and reason in message


def test_bad_listener_address(tmp_path: Path) -> None:
    text = valid_config().replace('address = "127.0.0.1:8080"', 'address = "localhost"')
    path = write(tmp_path, text)
    [(_, line, key, message)] = check_fails(path)
    assert (line, key) == (line_of(text, 'address = "localhost"'), "listeners[0].address")
    assert "invalid address" in message


@pytest.mark.parametrize(
    "old,new,key,expected",
    [("max_body_bytes = 4096", 'max_body_bytes = "4096"', "http.max_body_bytes",
      "expected integer, got string"),
     ('name = "backend"', "name = 7", "clusters[0].name", "expected string, got integer"),
     ('endpoints = ["127.0.0.1:9000", "127.0.0.1:9001"]', 'endpoints = "127.0.0.1:9000"',
      "clusters[0].endpoints", "expected array, got string"),
     ('method = "POST"', "method = 1", "routes[0].match.method",
      "expected string or array, got integer")],
    ids=["integer", "string", "array", "method"],
)
def test_wrong_type(tmp_path: Path, old: str, new: str, key: str, expected: str) -> None:
    text = valid_config().replace(old, new)
    assert new in text
    path = write(tmp_path, text)
    found = check_fails(path)
    assert (line_of(text, new), key) in [(line, k) for _, line, k, _ in found], found
    assert any(expected in message for *_, k, message in found if k == key), found


def test_out_of_range(tmp_path: Path) -> None:
    text = valid_config().replace("max_body_bytes = 4096", "max_body_bytes = -1")
    path = write(tmp_path, text)
    [(_, line, key, message)] = check_fails(path)
    assert (line, key) == (line_of(text, "max_body_bytes"), "http.max_body_bytes")
    assert "-1" in message


@pytest.mark.parametrize(
    "old,new,bad,where",
    [('name = "fallback"', 'name = "fallback', 'name = "fallback', "routes[1].name"),
     ('name = "fallback"', 'name = = "fallback"', 'name = = "fallback"', "routes[1].name"),
     ("[[routes]]", "[[routes]", "[[routes]", "routes[0]"),
     ('name = "fallback"', 'name = "fallback"\nname = "again"', 'name = "again"',
      "routes[1].name")],
    ids=["unterminated-string", "double-equals", "bad-table-header", "duplicate-key"],
)
def test_toml_syntax_error(tmp_path: Path, old: str, new: str, bad: str,
                           where: str) -> None:
    text = valid_config().replace(old, new, 1)
    path = write(tmp_path, text)
    [(_, line, key, message)] = check_fails(path)
    assert line == line_of(text, bad)
    assert (key, message.split(":")[0]) == (where, "syntax"), (key, message)


def test_several_problems_all_reported_in_line_order(tmp_path: Path) -> None:
    text = (valid_config()
            .replace("max_body_bytes = 4096", 'max_body_bytes = "big"')
            .replace('"127.0.0.1:9001"', '"nope"')
            .replace('cluster = "backend"\n\n[[routes]]', 'cluster = "ghost"\n\n[[routes]]')
            + "unknown_thing = 1\n")
    path = write(tmp_path, text)
    found = check_fails(path)
    assert [(line, key) for _, line, key, _ in found] == [
        (line_of(text, "max_body_bytes"), "http.max_body_bytes"),
        (line_of(text, '"nope"'), "clusters[0].endpoints[1]"),
        (line_of(text, '"ghost"'), "routes[0].cluster"),
        (line_of(text, "unknown_thing"), "routes[1].unknown_thing"),
    ]


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    res = aiproxy_cli("check", "-c", str(missing))
    assert res.returncode == 2
    assert res.stderr.startswith(f"{missing}: cannot read"), res.stderr


# -- run with a bad config -----------------------------------------------------------------


def _port_accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


@pytest.mark.parametrize("argv", [("-c",), ("run", "-c"), ("run", "--config")],
                         ids=["default-command", "run", "run-long-option"])
def test_run_with_bad_config_exits_2_before_binding(tmp_path: Path, argv: tuple[str, ...]
                                                    ) -> None:
    port = free_port()
    text = valid_config(port).replace('cluster = "backend"\n\n[[routes]]',
                                      'cluster = "ghost"\n\n[[routes]]')
    path = write(tmp_path, text)
    proc = start_process([sys.executable, "-m", "aiproxy", *argv, str(path)])
    try:
        accepted = False
        deadline = time.monotonic() + 15
        while proc.poll() is None and time.monotonic() < deadline:
            accepted = accepted or _port_accepts(port)
            time.sleep(0.01)
        assert proc.poll() == 2, f"exit {proc.poll()}"
    finally:
        log = stop_process(proc)
    assert not accepted, "the listener port accepted a connection"
    assert f"{path}:{line_of(text, 'ghost')}: routes[0].cluster: unknown cluster 'ghost'" in log
    assert "listener" not in log and "ready" not in log, log
    with socket.socket() as sock:  # still free: nothing holds it
        sock.bind(("127.0.0.1", port))


def test_run_with_bad_config_does_not_touch_a_busy_port(tmp_path: Path) -> None:
    """With the port already taken, a bind attempt would fail with exit 1 and a 'cannot
    bind' message; exit 2 with the config problem shows it never tried."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        text = valid_config(port).replace("max_body_bytes = 4096", "max_body_bytes = true")
        path = write(tmp_path, text)
        res = aiproxy_cli("-c", str(path))
    assert res.returncode == 2, res.stderr
    assert "cannot bind" not in res.stderr
    line = line_of(text, "max_body_bytes")
    assert f"{path}:{line}: http.max_body_bytes: expected integer, got boolean" in res.stderr


def test_run_with_syntax_error_exits_2(tmp_path: Path) -> None:
    port = free_port()
    text = valid_config(port) + "[[routes\n"
    path = write(tmp_path, text)
    res = aiproxy_cli("run", "-c", str(path))
    assert res.returncode == 2
    assert res.stderr.startswith(f"{path}:{len(text.splitlines())}: "), res.stderr
    assert not _port_accepts(port)


def test_check_warns_of_route_intents_the_model_does_not_predict(tmp_path: Path) -> None:
    """Only the loaded model knows its intents: `check` loads it and warns of a route
    matching one it never predicts (such a route matches only an explicit intent
    header); a model that does not load is an error with its line."""
    text = valid_config().replace('name = "fallback"', 'name = "fallback"\n'
                                  'match = { intent_domain = "bankng" }') + "\n[semantic]\n"
    path = write(tmp_path, text)
    res = aiproxy_cli("check", "-c", str(path))
    assert res.returncode == 0, res.stderr
    assert res.stderr == (
        f"warning: {path}:{line_of(text, 'bankng')}: routes[1].match.intent_domain: the model "
        "predicts no domain 'bankng' (did you mean 'banking'?): the route matches only "
        "requests that name it in x-model-intent\n")
    path = write(tmp_path, text.replace('intent_domain = "bankng"', 'intent = "transfer"'))
    res = aiproxy_cli("check", "-c", str(path))
    assert res.returncode == 0 and res.stderr == "", res.stderr
    text += 'model = "builtin:clinc15"\n'
    path = write(tmp_path, text)
    assert check_fails(path)[-1] == (
        str(path), line_of(text, "clinc15"), "semantic.model",
        "builtin:clinc15: no builtin model 'clinc15' (have: clinc150)")


@pytest.mark.parametrize("workers", [1, 2])
def test_run_with_a_bad_model_exits_2_before_binding(tmp_path: Path, workers: int) -> None:
    """An ONNX model that does not load is a problem with [semantic] model, found before
    any socket is bound (with workers too, whose supervisor binds the admin API and
    checks the ports first): with the listener's and the admin's ports taken, exit 2
    naming FILE:LINE: semantic.model shows neither bind was tried."""
    (tmp_path / "intent.onnx").write_bytes(b"not an onnx model\n")
    with socket.socket() as holder, socket.socket() as admin_holder:
        for sock in (holder, admin_holder):
            sock.bind(("127.0.0.1", 0))
            sock.listen(1)
        port, admin = holder.getsockname()[1], admin_holder.getsockname()[1]
        text = (f"[server]\nworkers = {workers}\n" + valid_config(port)
                + f'\n[admin]\naddress = "127.0.0.1:{admin}"\n'
                + '\n[semantic]\nmodel = "intent.onnx"\n')
        path = write(tmp_path, text)
        res = aiproxy_cli("-c", str(path), timeout=60)
    assert res.returncode == 2, res.stderr
    assert "cannot bind" not in res.stderr, res.stderr
    assert f"{path}:{line_of(text, 'intent.onnx')}: semantic.model: " in res.stderr, res.stderr
    assert "Traceback" not in res.stderr, res.stderr


def test_run_names_the_listener_that_cannot_bind(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        path = write(tmp_path, "[server]\nworkers = 1\n" + valid_config(port))
        res = aiproxy_cli("-c", str(path))
    assert res.returncode == 1, res.stderr
    assert (f"{path}: listener 'public': cannot bind 127.0.0.1:{port}: "
            "Address already in use") in res.stderr, res.stderr


@pytest.mark.parametrize("workers", [1, 2])
def test_run_names_the_admin_address_that_cannot_bind(tmp_path: Path, workers: int) -> None:
    """An admin address already taken is a problem with the config's [admin] address:
    FILE:LINE: admin.address, the address, exit 1, no traceback (with workers, the
    supervisor binds it)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        text = (f"[server]\nworkers = {workers}\n" + valid_config(free_port())
                + f'\n[admin]\naddress = "127.0.0.1:{port}"\n')
        path = write(tmp_path, text)
        res = aiproxy_cli("-c", str(path), timeout=60)
    assert res.returncode == 1, res.stderr
    line = line_of(text, f"127.0.0.1:{port}")
    assert (f"{path}:{line}: admin.address: cannot bind the admin API ([admin] address) "
            f"on 127.0.0.1:{port}: Address already in use") in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_unreadable_upstream_identity_secret_file(tmp_path: Path) -> None:
    """An [auth.upstream_identity] secret_file that exists but cannot be read was opened
    without a guard: `check` and `run` died with a Python traceback (exit 1).
    /proc/self/mem is a regular file whose first read fails (EIO), even for root, for
    whom a chmod 000 file stays readable."""
    text = valid_config() + '\n[auth]\nrequired = false\n\n[auth.upstream_identity]\n' \
        'secret_file = "/proc/self/mem"\n'
    path = write(tmp_path, text)
    line = line_of(text, "secret_file")
    expected = (f"{path}:{line}: auth.upstream_identity.secret_file: cannot read "
                "'/proc/self/mem': Input/output error")
    for argv in (("check", "-c"), ("-c",)):
        res = aiproxy_cli(*argv, str(path))
        assert res.returncode == 2, res.stderr
        assert "Traceback" not in res.stderr
        assert res.stderr.splitlines() == [expected], res.stderr
    (tmp_path / "short").write_text("only 15 bytes..\n")
    text = text.replace("/proc/self/mem", "short")
    path = write(tmp_path, text)
    assert check_fails(path) == [(str(path), line, "auth.upstream_identity.secret_file",
                                  "the secret must be at least 16 bytes")]


@pytest.mark.parametrize("text", ["", "   ", "?! ...", "\u200b"])
def test_router_classify_refuses_text_without_words(text: str) -> None:
    """The shipped model says "calculator" at 0.92 about a text without a word; the
    proxy routes such a request without an intent, and the CLI says there is nothing to
    classify (exit 2, as its other input errors) instead of printing that label."""
    for args in (("router", "classify", text), ("router", "classify", "--json", text)):
        r = aiproxy_cli(*args)
        assert r.returncode == 2, r
        assert r.stdout == "" and "no text to classify" in r.stderr, r
    r = aiproxy_cli("router", "classify", "--json", "?! what is my balance")
    assert r.returncode == 0 and '"label": "balance"' in r.stdout, r


@pytest.mark.parametrize("option,value,problem", [
    ("--batch", "0", "must be at least 1, not 0"),
    ("--batch", "-3", "must be at least 1, not -3"),
    ("--latency-rows", "-1", "must be at least 0, not -1"),
])
def test_router_eval_rejects_bad_counts(tmp_path: Path, option: str, value: str,
                                        problem: str) -> None:
    """--batch 0 was run as 1 and a negative --latency-rows as all rows: argument
    errors now, argparse's message and exit 2, before any model or data is read."""
    data = write(tmp_path, '{"text": "what is my balance", "intent": "balance"}\n', "d.jsonl")
    r = aiproxy_cli("router", "eval", "-m", "builtin:clinc150", "--data", str(data),
                    option, value)
    assert r.returncode == 2, r
    assert f"aiproxy router eval: error: argument {option}: {problem}" in r.stderr, r
    assert r.stdout == ""


def test_upstream_tls_without_verification_is_a_warning(tmp_path: Path, start_proxy) -> None:
    """`tls = { verify = false }` turns off the check that the upstream is who it says:
    accepted (a lab or a pinned network may need it), but said aloud by `check` and at
    start, with its file, line and key, never silently."""
    text = valid_config().replace('endpoints = ["127.0.0.1:9000", "127.0.0.1:9001"]',
                                  'endpoints = ["127.0.0.1:9000", "127.0.0.1:9001"]\n'
                                  'tls = { verify = false }')
    path = write(tmp_path, text)
    res = aiproxy_cli("check", "-c", str(path))
    warning = (f"{path}:{line_of(text, 'verify = false')}: clusters[0].tls.verify: cluster "
               "'backend' does not check its endpoints' TLS certificates or host names: "
               "anyone on the path can answer for them")
    assert res.returncode == 0, res.stderr
    assert res.stderr == f"warning: {warning}\n"
    proxy = start_proxy("[server]\nworkers = 1\n[[clusters]]" + text.split("[[clusters]]", 1)[1])
    log = stop_process(proxy.proc)
    assert "does not check its endpoints' TLS certificates" in log, log
    res = aiproxy_cli("check", "-c", str(write(tmp_path, valid_config())))
    assert res.returncode == 0 and res.stderr == "", res.stderr


@pytest.mark.parametrize("admin, warned", [
    ('address = "0.0.0.0:9901"', True),
    ('address = "[::]:9901"', True),
    ('address = "192.0.2.10:9901"', True),
    ('address = "admin.example:9901"', True),
    ('address = "0.0.0.0:9901"\ntoken = "s3cret"', False),
    ('address = "127.0.0.2:9901"', False),
    ('address = "[::1]:9901"', False),
    ('address = "localhost:9901"', False),
])
def test_admin_off_loopback_without_token_is_a_warning(tmp_path: Path, admin: str,
                                                      warned: bool) -> None:
    """Off loopback and without a token, the admin API lets anyone who reaches it read
    /config and POST /config/reload: accepted (a private network may be meant), but
    said aloud with its file, line and key."""
    text = valid_config() + f"\n[admin]\n{admin}\n"
    path = write(tmp_path, text)
    res = aiproxy_cli("check", "-c", str(path))
    assert res.returncode == 0, res.stderr
    if not warned:
        assert res.stderr == "", res.stderr
        return
    address = admin.split('"')[1]
    assert res.stderr == (
        f"warning: {path}:{line_of(text, admin)}: admin.address: the admin API on "
        f"'{address}' is off loopback and has no token: anyone who reaches it can read "
        "/config and POST /config/reload (set [admin] token, or keep it on loopback)\n")


@pytest.mark.parametrize("key", ["caf\u00e9-key-0123456789".encode(), b"\xffraw-key-0123456789"])
def test_hash_key_of_a_non_ascii_key_matches_what_the_proxy_sees(
        tmp_path: Path, start_proxy, demo_upstream, key: bytes) -> None:
    """`auth hash-key` read stdin as UTF-8: a byte that is not UTF-8 was a traceback, and a
    UTF-8 key got a hash the proxy never matched (it reads a header's bytes as Latin-1,
    one character a byte). The key's bytes are hashed as the proxy hashes them."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    res = subprocess.run([sys.executable, "-m", "aiproxy", "auth", "hash-key"],
                         input=key + b"\n", capture_output=True, timeout=20, env=env)
    assert res.returncode == 0 and b"Traceback" not in res.stderr, res
    stored = res.stdout.decode().strip()
    proxy = start_proxy("[server]\nworkers = 1\n" + simple_config(demo_upstream)
                        + f'[auth]\n[[auth.api_keys]]\nid = "k"\nsubject = "s"\n'
                        f'hash = "{stored}"\n')
    with httpx.Client() as client:
        assert client.get(f"{proxy.url}/echo", headers={"x-api-key": key}).status_code == 200
        assert client.get(f"{proxy.url}/echo",
                          headers={"x-api-key": key + b"x"}).status_code == 401


POLICY = """\
default = "deny"
[roles]
analyst = ["route:chat", "model:gpt-4o*", "intent:*"]

[[rules]]
id = "no-lab-net"
effect = "deny"
source_cidrs = ["10.66.0.0/16"]

[[rules]]
id = "analysts"
effect = "allow"
rbac = true
methods = ["POST"]
"""


@pytest.mark.parametrize("request_json,problem", [
    ('{"method": 5}', "method: expected a string, not 5"),
    ('{"roles": "analyst"}', 'roles: expected a list of strings, not "analyst"'),
    ('{"roles": [1]}', "roles: expected a list of strings, not [1]"),
    ('{"claims": [1]}', "claims: expected a JSON object, not [1]"),
    ('{"source": "nope"}', 'source: expected an IP address, not "nope"'),
    ('{"body_bytes": "9"}', 'body_bytes: expected a whole number of bytes, not "9"'),
    ('{"body_bytes": -1}', "body_bytes: expected a whole number of bytes, not -1"),
    ('{"time": 5}', "time: expected an ISO 8601 time such as 2026-01-05T10:00:00Z, not 5"),
    ('{"time": "yesterday"}',
     'time: expected an ISO 8601 time such as 2026-01-05T10:00:00Z, not "yesterday"'),
    ('{"now": 1}', "unknown field 'now' (known: subject, roles, claims, method, path, route, "
                   "model, intent, domain, source, body_bytes, time)"),
    ('[]', "expected a JSON object"),
])
def test_policy_explain_rejects_bad_request_fields(tmp_path: Path, request_json: str,
                                                   problem: str) -> None:
    """A field of the wrong type was a traceback ("method": 5), a Python message
    ("'int' object has no attribute 'replace'") or quietly another request: "roles":
    "analyst" was the roles a, n, l, ..., a bad "source" or "body_bytes" matched no rule.
    Each is one line naming the field, exit 2, and no decision is printed."""
    write(tmp_path, POLICY, "policy.toml")
    path = write(tmp_path, valid_config() + '\n[policy]\nfiles = ["policy.toml"]\n')
    res = aiproxy_cli("policy", "explain", "-c", str(path), "--request", request_json)
    assert res.returncode == 2, res
    assert res.stdout == ""
    assert res.stderr == f"--request: {problem}\n", res.stderr
    res = aiproxy_cli("policy", "explain", "-c", str(path), "--request",
                      '{"roles": ["analyst"], "method": "POST", "route": "chat", '
                      '"model": "gpt-4o", "source": "10.0.0.1", "body_bytes": 10, '
                      '"claims": {}, "time": "2026-01-05T10:00:00Z"}')
    assert res.returncode == 0 and res.stdout.startswith("decision: allow (rule analysts)"), res


@pytest.mark.parametrize("args,problem", [
    (("--where", "path~[v1"), "--where 'path~[v1': bad regular expression: unterminated "
                              "character set at position 0"),
    (("--since", "yesterday"), "--since 'yesterday': expected a duration (15m, 1h, 2d) or "
                               "an ISO time"),
])
def test_audit_query_bad_arguments(tmp_path: Path, args: tuple[str, ...], problem: str) -> None:
    """A --where regular expression that does not compile was a re.error traceback, and
    a bad --since said only "Invalid isoformat string": one line naming the option,
    exit 2."""
    log = write(tmp_path, '{"time": "2026-11-30T00:00:00Z", "path": "/v1/x"}\n', "audit.log")
    res = aiproxy_cli("audit", "query", str(log), *args)
    assert res.returncode == 2, res
    assert res.stdout == ""
    assert res.stderr == f"aiproxy audit: {problem}\n", res.stderr


@pytest.mark.parametrize("option,value,problem", [
    ("--epochs", "0", "must be at least 1, not 0"),
    ("--epochs", "-1", "must be at least 1, not -1"),
    ("--batch", "0", "must be at least 1, not 0"),
    ("--dim", "0", "must be at least 1, not 0"),
    ("--ensemble", "0", "must be at least 1, not 0"),
    ("--jobs", "0", "must be at least 1, not 0"),
    ("--hidden", "-1", "must be at least 0, not -1"),
    ("--dropout", "1", "must be at least 0 and below 1, not 1.0"),
    ("--dropout", "2", "must be at least 0 and below 1, not 2.0"),
    ("--hidden-dropout", "-0.5", "must be at least 0 and below 1, not -0.5"),
    ("--feature-dropout", "1", "must be at least 0 and below 1, not 1.0"),
    ("--vocab-dropout", "nan", "must be at least 0 and below 1, not nan"),
    ("--label-smoothing", "1", "must be at least 0 and below 1, not 1.0"),
])
def test_router_train_rejects_bad_settings(tmp_path: Path, option: str, value: str,
                                           problem: str) -> None:
    """--epochs 0, --batch 0 and --dim 0 were tracebacks (UnboundLocalError,
    ZeroDivisionError) after the data was read; --ensemble 0 was trained as 1 and
    --dropout 2 zeroed every input (a model of nothing, exit 0). Argument errors now,
    exit 2, before any data is read or a model written."""
    data = write(tmp_path, '{"text": "what is my balance", "intent": "balance"}\n', "d.jsonl")
    out = tmp_path / "m.onnx"
    r = aiproxy_cli("router", "train", "--data", str(data), "-o", str(out), "-q",
                    option, value)
    assert r.returncode == 2, r
    assert f"aiproxy router train: error: argument {option}: {problem}" in r.stderr, r
    assert r.stdout == "" and not out.exists()
