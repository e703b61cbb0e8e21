"""What a reload cannot apply: listener sockets and the admin API's address are bound at
start, the number of workers is fixed then, the access log is opened then, and XDP
programs stay attached in the [kernel] xdp_mode they were attached in. A reload applies
the rest (the admin token included: every admin request reads the current one); these
helpers say what waits for a restart and what the process still serves meanwhile, for
the reload's answer and the admin API's /config."""

from __future__ import annotations

import dataclasses

from aiproxy.config import Config
from aiproxy.config.schema import ListenerConfig
from aiproxy.server.tls import restart_shape


def bound_listeners(bound: tuple[ListenerConfig, ...],
                    new: tuple[ListenerConfig, ...]) -> tuple[ListenerConfig, ...]:
    """The listeners served after a reload to `new`: the bound ones, each replaced by its
    namesake in `new` when only TLS file paths differ (a reload loads those)."""
    fresh = {listener.name: listener for listener in new}
    return tuple(fresh[lst.name] if lst.name in fresh
                 and restart_shape([fresh[lst.name]]) == restart_shape([lst]) else lst
                 for lst in bound)


def _changed(was: ListenerConfig, now: ListenerConfig) -> list[str]:
    keys = [f.name for f in dataclasses.fields(now)
            if f.name not in ("tls", "host", "port") and getattr(now, f.name) != getattr(was, f.name)]
    if ((was.tls is None) != (now.tls is None)
            or (was.tls is not None and now.tls is not None
                and (was.tls.ca is None) != (now.tls.ca is None))):
        keys.append("tls")
    return keys


def pending_restart(started: Config, new: Config) -> list[str]:
    """What of `new` only a restart applies, against what the process bound at start
    (`started`, or a served_config of it): one line each, naming the key, what is
    wanted and what is served."""
    out = []
    old = {listener.name: listener for listener in started.listeners}
    fresh = {listener.name: listener for listener in new.listeners}
    for name, now in fresh.items():
        was = old.get(name)
        if was is None:
            out.append(f"listeners.{name}: new listener on {now.address}, not bound")
        elif restart_shape([was]) != restart_shape([now]):
            keys = _changed(was, now)
            detail = (f" {now.address} (serving {was.address})" if "address" in keys else "")
            out.append(f"listeners.{name}: {', '.join(keys)} changed{detail}")
    out += [f"listeners.{name}: removed, still serving {was.address}"
            for name, was in old.items() if name not in fresh]
    a, b = started.admin, new.admin
    if a is None and b is not None:
        out.append(f"admin: new admin API on {b.address}, not bound")
    elif a is not None and b is None:
        out.append(f"admin: removed, still serving {a.address} (with its token)")
    elif a is not None and b is not None and a.address != b.address:
        out.append(f"admin.address: {b.address} (serving {a.address})")
    if started.server.workers != new.server.workers:
        out.append(f"server.workers: {new.server.workers} (running {started.server.workers})")
    # The access log is opened at start: a reload keeps writing the file it has.
    for key in ("path", "flush_interval_ms"):
        was_value, now_value = getattr(started.access_log, key), getattr(new.access_log, key)
        if was_value != now_value:
            out.append(f"access_log.{key}: {now_value} (serving {was_value})")
    # XDP stays attached in the mode it was attached in; only an interface new to the
    # config is attached in a new xdp_mode.
    kept = _kept_interfaces(started, new)
    if kept and started.kernel.xdp_mode != new.kernel.xdp_mode:
        out.append(f"kernel.xdp_mode: {new.kernel.xdp_mode} ({', '.join(kept)} attached "
                   f"with {started.kernel.xdp_mode})")
    return out


def _kept_interfaces(started: Config, new: Config) -> list[str]:
    return [name for name in new.kernel.interfaces if name in started.kernel.interfaces]


def served_config(served: Config, config: Config) -> Config:
    """`config` as the process serves it, given `served` (what it served before this
    config, the one it started with at first): the listeners, admin address and workers
    bound at start, with what a reload applies (TLS files, the admin token). An [admin]
    section removed leaves the API serving with the token it had."""
    admin = config.admin
    if served.admin is None:
        admin = None
    elif admin is None:
        admin = served.admin
    else:
        admin = dataclasses.replace(admin, address=served.admin.address,
                                    host=served.admin.host, port=served.admin.port)
    kernel = config.kernel
    if _kept_interfaces(served, config):
        kernel = dataclasses.replace(kernel, xdp_mode=served.kernel.xdp_mode)
    return dataclasses.replace(
        config, listeners=bound_listeners(served.listeners, config.listeners), admin=admin,
        server=dataclasses.replace(config.server, workers=served.server.workers),
        access_log=served.access_log, kernel=kernel)
