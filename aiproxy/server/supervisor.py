"""The supervising parent of `[server] workers = N` (N > 1).

It starts N worker processes (aiproxy.server.worker) from a multiprocessing forkserver
that has the proxy imported already (aiproxy.server.forkserver), so a start or restart
is a fork, not a fresh interpreter. Each worker binds the listeners with SO_REUSEPORT.
The parent binds no proxy listener; it serves the admin API, sums the workers' metrics, speaks sd_notify for
the service and restarts a worker that dies (exponential backoff, capped).

Signals: SIGTERM/SIGINT/SIGQUIT drain every worker (SIGKILL after drain_timeout plus a margin);
SIGHUP validates the file here and, if it is good, sends the validated text to each
worker, which swaps it in place (see reload()); SIGUSR1 is passed on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from typing import TYPE_CHECKING, Any

import uvloop
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import CollectorRegistry

from aiproxy.config import (
    Config,
    ConfigError,
    load_config_text,
    read_config_text,
)
from aiproxy.server import HURRY_SIGNALS, STOP_SIGNALS, forkserver, sd_notify
from aiproxy.server.channel import Channel
from aiproxy.server.pending import pending_restart, served_config
from aiproxy.server.sockets import bound_sockets
from aiproxy.telemetry.aggregate import WorkerMetrics, merge, to_metrics

if TYPE_CHECKING:
    from aiproxy.admin.server import AdminServer

log = logging.getLogger("aiproxy.server")

BACKOFF_BASE = 0.1  # seconds before restarting a worker that had run for a while
BACKOFF_CAP = 30.0
STABLE_AFTER = 10.0  # a worker that lived this long resets the backoff
STOP_MARGIN = 5.0  # past drain_timeout, before stragglers get SIGKILL
SCRAPE_TIMEOUT = 2.0
HANG_CHECK_INTERVAL = 5.0  # seconds between liveness pings (less for a short hang timeout)
# Families the supervisor owns: workers' own reload counters would count each reload N times.
PARENT_FAMILIES = frozenset({"aiproxy_config_reloads", "aiproxy_config_reload_failures",
                             "aiproxy_config_last_reload_success"})


def exit_reason(code: int | None) -> str:
    if code is None:
        return "vanished"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class WorkerSlot:
    """Worker number `index` (the `worker` label); its process changes on restarts."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.process: Any = None  # multiprocessing.Process while one runs
        self.pid: int | None = None
        self.channel: Channel | None = None
        self.reader: asyncio.Task | None = None
        self.ready = False
        self.text = ""  # the config text this worker runs
        self.started = 0.0
        self.restarts = 0
        self.hangs = 0  # times killed for not answering (each also counts in restarts)
        self.ping_sent: float | None = None  # when the unanswered ping went out
        self.ping: asyncio.Task | None = None
        self.streak = 0  # quick deaths in a row
        self.metrics = WorkerMetrics()
        self.restart_timer: asyncio.TimerHandle | None = None

    @property
    def running(self) -> bool:
        return self.process is not None


class Supervisor:
    def __init__(self, config: Config, text: str, log_level: int = logging.INFO) -> None:
        self.config = config
        self.text = text
        # What this proxy serves of what only a restart changes (pending.py): a worker
        # replaced after a reload that changed listeners binds what its siblings do.
        self.served = config
        self.log_level = log_level
        self.slots = [WorkerSlot(i) for i in range(config.server.workers)]
        # every [kernel] interface worker 0 may have attached to (union over reloads)
        self.kernel_interfaces: set[str] = set(config.kernel.interfaces)
        self.mp = forkserver.context()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stopping = False
        self.startup: asyncio.Future | None = None
        self.all_exited = asyncio.Event()
        self.admin: AdminServer | None = None
        self.reload_lock = asyncio.Lock()
        self.reloads = 0
        self.reload_failures = 0
        self.last_reload_ok = 1
        self.hang_checked = 0.0  # when _check_hangs last ran
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(WorkersCollector(self))

    # -- lifecycle ---------------------------------------------------------------------

    def model_loads(self) -> bool:
        """Whether the [semantic] model loads, checked in a process of the forkserver
        (the supervisor never imports the model runtime) before anything is bound, as a
        single process checks it; the process logs why not."""
        if self.config.semantic is None:
            return True
        check = self.mp.Process(target=_check_model, name="aiproxy-model-check",
                                args=(self.text, self.config.source, self.log_level))
        check.start()
        check.join()
        if check.exitcode == 0:
            return True
        if check.exitcode != 2:
            log.error("%s: the [semantic] model check ended with %s", self.config.source,
                      exit_reason(check.exitcode))
        return False

    async def main(self) -> int:
        loop = self.loop = asyncio.get_running_loop()
        busy = ports_in_use(self.config)
        if busy:
            log.error("%s: %s", self.config.source, busy)  # as a single process words it
            return 1
        stop = asyncio.Event()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, stop.set)
        admin = self.config.admin
        if admin is not None:
            # aiohttp only when there is an admin listener: it is most of this process's
            # import time, and the workers' start waits for it
            from aiproxy.admin.server import AdminServer, bind_problem

            self.admin = AdminServer(self)
            try:
                await self.admin.start(admin.host, admin.port)
            except OSError as exc:
                log.error("%s", bind_problem(self.config, exc))
                await self.admin.stop()
                return 1
            log.info("admin API on %s", admin.address)
        if self.kernel_interfaces:
            from aiproxy.kernel.lifecycle import remove_stale_pins

            remove_stale_pins()
        self.startup = loop.create_future()
        for slot in self.slots:
            self.spawn(slot)
        stopped = loop.create_task(stop.wait())
        await asyncio.wait([self.startup, stopped], return_when=asyncio.FIRST_COMPLETED)
        code = self.startup.result() if self.startup.done() else 0
        if stop.is_set() and code == 0:
            self.startup.cancel()  # asked to stop before every worker was up
        elif code != 0:
            log.error("a worker failed to start; stopping")
            # The others are told to stop (SIGTERM) and, having nothing to drain, do so
            # at once; SIGKILL only for one that does not.
            await self.stop_workers(STOP_MARGIN)
            await self._release_kernel()
            await self._stop_admin()
            return code
        else:
            watchdog = sd_notify.watchdog_interval()
            if watchdog:
                def _ping() -> None:
                    sd_notify.notify("WATCHDOG=1")
                    loop.call_later(watchdog, _ping)
                _ping()
            self._check_hangs()
            # Ignored until now (_run): a reload before every worker serves would reach
            # none of them, and tell systemd READY=1 early.
            loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(self.reload()))
            loop.add_signal_handler(signal.SIGUSR1, self.signal_workers, signal.SIGUSR1)
            log.info("aiproxy ready: %d workers (%d routes, %d clusters)", len(self.slots),
                     len(self.config.routes), len(self.config.clusters))
            sd_notify.notify("READY=1")
        await stopped
        sd_notify.notify("STOPPING=1")
        for sig in HURRY_SIGNALS:  # a second one: the workers stop draining
            loop.add_signal_handler(sig, self.hurry_workers)
        drain = self.config.server.drain_timeout_ms / 1000
        log.info("stopping: workers drain for up to %.0f ms", drain * 1000)
        await self.stop_workers(drain + STOP_MARGIN)
        await self._release_kernel()
        await self._stop_admin()
        log.info("stopped")
        return 0

    async def _release_kernel(self) -> None:
        """Worker 0 detaches [kernel] XDP/TC when it stops; if it was SIGKILLed instead,
        its programs are still attached: detach them here, once every worker is gone."""
        if not self.kernel_interfaces:
            return
        from aiproxy.kernel.lifecycle import proxy_pin_dir, release_orphaned

        assert self.loop is not None
        try:
            await self.loop.run_in_executor(None, release_orphaned, self.kernel_interfaces,
                                            proxy_pin_dir(os.getpid()))
        except Exception as exc:  # never fail the stop over this
            log.warning("kernel: clean-up after worker 0: %s", exc)

    async def _stop_admin(self) -> None:
        if self.admin is not None:
            await self.admin.stop()

    def spawn(self, slot: WorkerSlot) -> None:
        slot.restart_timer = None
        if self.stopping:
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        process = self.mp.Process(
            target=_worker_main, name=f"aiproxy-worker-{slot.index}", daemon=False,
            args=(slot.index, theirs, self.text, self.config.source, self.log_level,
                  os.getpid(), self.served.listeners))
        try:
            process.start()
        except OSError as exc:
            ours.close()
            theirs.close()
            slot.started = time.monotonic()
            self._restart_later(slot, f"cannot be started ({exc})")
            return
        finally:
            theirs.close()
        slot.process = process
        slot.pid = process.pid
        slot.text = self.text
        slot.ready = False
        slot.ping_sent = None
        slot.started = time.monotonic()
        self.all_exited.clear()
        log.info("worker %d started (pid %d)", slot.index, process.pid)
        assert self.loop is not None
        self.loop.add_reader(process.sentinel, self._exited, slot, process)
        slot.reader = self.loop.create_task(self._serve_channel(slot, ours))

    async def _serve_channel(self, slot: WorkerSlot, sock: socket.socket) -> None:
        channel = slot.channel = await Channel.open(sock)

        def on_event(name: str, fields: dict[str, Any]) -> None:
            if name == "ready":
                self._ready(slot)
            elif name == "final":
                slot.metrics.live = fields["metrics"]

        await channel.serve({}, on_event)

    def _ready(self, slot: WorkerSlot) -> None:
        slot.ready = True
        log.info("worker %d (pid %s) is serving", slot.index, slot.pid)
        if slot.text != self.text:
            # started from the old text while a reload was under way
            assert self.loop is not None
            self.loop.create_task(self._reload_worker(slot, self.text))
        if (self.startup is not None and not self.startup.done()
                and all(s.ready for s in self.slots)):
            self.startup.set_result(0)

    def _exited(self, slot: WorkerSlot, process: Any) -> None:
        assert self.loop is not None
        self.loop.remove_reader(process.sentinel)
        self.loop.create_task(self._reap(slot, process))

    async def _reap(self, slot: WorkerSlot, process: Any) -> None:
        slot.ready = False
        code = process.exitcode
        process.close()
        if slot.reader is not None:
            # the worker's last words (its final metrics) are still in the socket
            with contextlib.suppress(TimeoutError, ConnectionError):
                await asyncio.wait_for(asyncio.shield(slot.reader), 1.0)
            slot.reader.cancel()
        if slot.channel is not None:
            await slot.channel.close()
        slot.metrics.retire()
        pid = slot.pid
        slot.process = slot.channel = slot.reader = None
        slot.ready = False
        if not any(s.running for s in self.slots):
            self.all_exited.set()
        if self.stopping:
            # -SIGTERM: one still starting, before its handler, died of the SIGTERM we sent
            level = logging.INFO if code in (0, -signal.SIGTERM) else logging.WARNING
            log.log(level, "worker %d (pid %s) %s", slot.index, pid, exit_reason(code))
            return
        if self.startup is not None and not self.startup.done():
            log.error("worker %d (pid %s) %s during startup", slot.index, pid,
                      exit_reason(code))
            self.startup.set_result(code if code else 1)
            return
        self._restart_later(slot, f"(pid {pid}) {exit_reason(code)}")

    def _restart_later(self, slot: WorkerSlot, why: str) -> None:
        """Restart after a delay that doubles with each quick death (capped)."""
        assert self.loop is not None
        lived = time.monotonic() - slot.started
        slot.streak = 0 if lived >= STABLE_AFTER else slot.streak + 1
        delay = min(BACKOFF_BASE * 2 ** slot.streak, BACKOFF_CAP)
        log.error("worker %d %s after %.1f s; restarting in %.1f s", slot.index, why, lived,
                  delay)
        slot.restarts += 1
        slot.restart_timer = self.loop.call_later(delay, self.spawn, slot)

    # -- liveness ------------------------------------------------------------------------

    def _check_hangs(self) -> None:
        """Every few seconds, ping each serving worker over its channel; one whose event
        loop has left a ping unanswered for worker_hang_timeout_ms (a filter in an endless
        loop, a blocking call, a stopped process) is SIGKILLed, and restarted as any worker
        that dies. Time before a worker reported ready (model load) is not counted; a
        reload's slow parts run in threads, so its loop keeps answering meanwhile."""
        assert self.loop is not None
        timeout = self.config.server.worker_hang_timeout_ms / 1000
        interval = min(HANG_CHECK_INTERVAL, timeout / 4) if timeout else HANG_CHECK_INTERVAL
        now = time.monotonic()
        # Late by more than a round: this process did not run either (stopped, frozen
        # cgroup); that time is not the workers' to answer for.
        late = now - self.hang_checked - interval if self.hang_checked else 0.0
        self.hang_checked = now
        for slot in self.slots:
            if self.stopping or not timeout or not slot.ready or slot.channel is None:
                slot.ping_sent = None
                continue
            if slot.ping_sent is None:
                slot.ping_sent = now
                slot.ping = self.loop.create_task(self._ping(slot, slot.channel))
                continue
            if late > interval:
                slot.ping_sent += late
            silent = now - slot.ping_sent
            if silent >= timeout and slot.pid is not None and slot.running:
                log.error("worker %d (pid %d) has not answered for %.1f s: killing it",
                          slot.index, slot.pid, silent)
                slot.hangs += 1
                slot.ping_sent = None
                slot.ready = False  # not serving; _reap restarts it
                with contextlib.suppress(ProcessLookupError):
                    os.kill(slot.pid, signal.SIGKILL)
        if not self.stopping:
            self.loop.call_later(interval, self._check_hangs)

    async def _ping(self, slot: WorkerSlot, channel: Channel) -> None:
        try:
            await channel.call("ping")
        except ConnectionError:
            return  # the worker is gone: _reap takes over
        except RuntimeError:
            pass  # an error reply is an answer from its loop too
        if slot.channel is channel:  # not a replaced worker's late answer
            slot.ping_sent = None

    def signal_workers(self, sig: int) -> None:
        for slot in self.slots:
            if slot.pid is not None and slot.running:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(slot.pid, sig)

    def hurry_workers(self) -> None:
        log.warning("asked again to stop: workers end their drain now")
        for slot in self.slots:
            if slot.channel is not None:
                slot.channel.send({"op": "hurry"})  # no reply awaited

    async def stop_workers(self, timeout: float) -> None:
        """SIGTERM (each worker drains), then SIGKILL whoever is left after `timeout`."""
        self.stopping = True
        for slot in self.slots:
            if slot.restart_timer is not None:
                slot.restart_timer.cancel()
                slot.restart_timer = None
        if not any(s.running for s in self.slots):
            return
        self.signal_workers(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.all_exited.wait(), timeout)
        except TimeoutError:
            left = [s.index for s in self.slots if s.running]
            log.warning("workers %s still running after %.1f s: SIGKILL", left, timeout)
            self.signal_workers(signal.SIGKILL)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.all_exited.wait(), 5)

    # -- reload ------------------------------------------------------------------------

    async def reload(self) -> tuple[bool, str]:
        """Validate the file here; if it is good, every worker swaps the same text in
        place (ProxyServer.reload: requests in flight finish on the old runtime, upstream
        pools, health and outlier state carry over). Replacing workers instead would
        throw that state away and, with SO_REUSEPORT, reset connections still queued in
        a retiring worker's accept backlog."""
        assert self.loop is not None
        async with self.reload_lock:
            sd_notify.reloading()
            source = self.config.source
            try:
                text = await self.loop.run_in_executor(None, read_config_text, source)
                config = await self.loop.run_in_executor(None, load_config_text, text, source)
            except ConfigError as exc:
                return self._reload_failed(str(exc))
            # A worker that comes up meanwhile runs the text it was started with, which
            # _ready() took for current: it is reloaded in the next round.
            live: list[WorkerSlot] = []
            results: list[tuple[bool, str]] = []
            asked: set[int | None] = set()
            while todo := [s for s in self._serving() if s.pid not in asked]:
                asked.update(s.pid for s in todo)
                live += todo
                results += await asyncio.gather(*(self._reload_worker(s, text)
                                                  for s in todo))
            live = list(dict.fromkeys(live))  # a slot restarted meanwhile came twice
            problems = [message for ok, message in results if not ok]
            if problems:
                # All or nothing: worker 0 alone attaches [kernel] interfaces, so it may
                # reject what the others took.
                await self._undo_reload([s for s in live if s.text == text != self.text])
                return self._reload_failed(problems[0])
            # (each worker re-reads its TLS listeners' changed certificate and key files)
            notes = pending_restart(self.served, config)
            if notes:
                notes.insert(0, "waiting for a restart")
                log.warning("reload: %s", "; ".join(notes))
            self.config = config
            self.served = served_config(self.served, config)
            self.kernel_interfaces |= set(config.kernel.interfaces)
            self.text = text
            self.reloads += 1
            self.last_reload_ok = 1
            log.info("config reloaded in %d workers (%d routes, %d clusters)", len(live),
                     len(config.routes), len(config.clusters))
            sd_notify.notify("READY=1")
            return True, "; ".join(notes) or "ok"

    async def _reload_worker(self, slot: WorkerSlot, text: str) -> tuple[bool, str]:
        channel = slot.channel
        if channel is None:
            return True, "not running"  # it starts from the new text
        try:
            result = await channel.call("reload", text=text)
        except (ConnectionError, RuntimeError) as exc:
            if slot.running and not channel.closed:
                return False, f"worker {slot.index}: {exc}"
            return True, "exited"  # its replacement starts from the new text
        if result["ok"]:
            slot.text = text
        return result["ok"], result["message"]

    async def _undo_reload(self, slots: list[WorkerSlot]) -> None:
        """Put workers that took a reload another one rejected back on the running text;
        one that cannot go back is restarted (it starts from the running text)."""
        results = await asyncio.gather(*(self._reload_worker(s, self.text) for s in slots))
        for slot, (ok, message) in zip(slots, results, strict=True):
            if ok:
                log.info("worker %d is back on the running config", slot.index)
            elif slot.pid is not None and slot.running:
                log.error("worker %d cannot go back to the running config, restarting "
                          "it: %s", slot.index, message)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(slot.pid, signal.SIGTERM)

    def _reload_failed(self, message: str) -> tuple[bool, str]:
        self.reload_failures += 1
        self.last_reload_ok = 0
        log.error("reload rejected, keeping the running config:\n%s", message)
        sd_notify.notify("READY=1")
        return False, message

    # -- admin backend (aiproxy.admin.server.AdminBackend) -------------------------------

    def problems(self) -> list[str]:
        problems = []
        if self.stopping:
            problems.append("draining")
        for slot in self.slots:
            if not slot.ready:
                problems.append(f"worker {slot.index} not serving")
        for cluster in self.config.clusters:
            if not cluster.endpoints:
                problems.append(f"cluster {cluster.name} has no endpoints")
        return problems

    def _serving(self) -> list[WorkerSlot]:
        return [s for s in self.slots if s.ready and s.channel is not None]

    async def refresh_metrics(self) -> None:
        slots = self._serving()
        pids = [s.pid for s in slots]
        results = await asyncio.gather(
            *(s.channel.call("metrics", SCRAPE_TIMEOUT) for s in slots),  # type: ignore[union-attr]
            return_exceptions=True)
        for slot, pid, result in zip(slots, pids, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("worker %d did not answer a scrape: %r", slot.index, result)
            elif slot.ready and slot.pid == pid:  # not reaped (or replaced) meanwhile
                slot.metrics.live = result

    async def routes(self) -> list[dict[str, Any]]:
        for slot in self._serving():
            with contextlib.suppress(ConnectionError, TimeoutError):
                return await slot.channel.call("routes", SCRAPE_TIMEOUT)  # type: ignore
        return []

    async def clusters(self) -> list[dict[str, Any]]:
        """Each worker's view of each cluster (health, ejections and in-flight counts are
        per process), tagged with the worker's number."""
        out = []
        for slot in self._serving():
            with contextlib.suppress(ConnectionError, TimeoutError):
                for cluster in await slot.channel.call("clusters", SCRAPE_TIMEOUT):  # type: ignore
                    out.append({**cluster, "worker": slot.index})
        return out


    async def spans(self, trace_id: str) -> list[dict[str, Any]] | None:
        """A trace's spans from every worker (each keeps the hops it proxied)."""
        if self.config.tracing is None:
            return None
        out: list[dict[str, Any]] = []
        for slot in self._serving():
            with contextlib.suppress(ConnectionError, TimeoutError):
                out += await slot.channel.call("spans", SCRAPE_TIMEOUT, trace_id=trace_id) or []
        return out


class WorkersCollector:
    """The workers' metrics summed, the supervisor's reload metrics, and per-worker
    series labelled worker="N"."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    def collect(self) -> Any:
        sup = self.supervisor
        families: dict = {}
        for slot in sup.slots:
            for part in slot.metrics.parts():
                merge(families, part, PARENT_FAMILIES)
        yield from to_metrics(families)
        yield CounterMetricFamily("aiproxy_config_reloads", "Successful config reloads",
                                  value=sup.reloads)
        yield CounterMetricFamily("aiproxy_config_reload_failures", "Rejected config reloads",
                                  value=sup.reload_failures)
        yield GaugeMetricFamily("aiproxy_config_last_reload_success",
                                "1 if the last reload succeeded (or none happened)",
                                value=sup.last_reload_ok)
        up = GaugeMetricFamily("aiproxy_worker_up", "1 while the worker process serves",
                               labels=["worker"])
        restarts = CounterMetricFamily("aiproxy_worker_restarts",
                                       "Times the supervisor restarted the worker",
                                       labels=["worker"])
        hangs = CounterMetricFamily("aiproxy_worker_hangs",
                                    "Times the supervisor killed the worker because its "
                                    "event loop did not answer for worker_hang_timeout_ms",
                                    labels=["worker"])
        requests = CounterMetricFamily("aiproxy_worker_requests",
                                       "Requests answered by the worker (all its processes)",
                                       labels=["worker"])
        for slot in sup.slots:
            label = [str(slot.index)]
            up.add_metric(label, 1 if slot.ready else 0)
            restarts.add_metric(label, slot.restarts)
            hangs.add_metric(label, slot.hangs)
            requests.add_metric(label, slot.metrics.total("aiproxy_requests_total"))
        yield up
        yield restarts
        yield hangs
        yield requests


def ports_in_use(config: Config) -> str | None:
    """Workers bind with SO_REUSEPORT, which would quietly share a port with another
    aiproxy (same user) already on it; a plain bind here catches that first."""
    for listener in config.listeners:
        try:
            socks = bound_sockets(listener.host, listener.port)
        except OSError as exc:  # socket.gaierror too
            why = exc.strerror or str(exc)
            return f"listener '{listener.name}': cannot bind {listener.address}: {why}"
        for sock in socks:
            sock.close()
    return None


def _worker_main(*args: Any) -> None:
    from aiproxy.server.worker import main

    main(*args)


def _check_model(*args: Any) -> None:
    from aiproxy.server.worker import check_model

    check_model(*args)


def run(config: Config, log_level: int | None = None) -> int:
    try:
        text = read_config_text(config.source)
        # what the workers run must be exactly the text validated here
        config = load_config_text(text, config.source)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    level = log_level if log_level is not None else logging.getLogger().getEffectiveLevel()
    supervisor = Supervisor(config, text, level)
    if not supervisor.model_loads():
        return 2
    return uvloop.run(supervisor.main())
