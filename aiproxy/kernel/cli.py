"""`aiproxy bpf status|attach|detach -c FILE [--netns NAME] [--json]` for operators.

attach loads the programs, pins their maps under /sys/fs/bpf/aiproxy/<netns|_host>/,
fills the maps from the config's [kernel] section and attaches to its interfaces; run it
again after editing the config to update the maps in place (it refuses an interface
with another tool's XDP program). detach removes aiproxy's programs from the interfaces
(another tool's XDP program stays, named on stderr) and the pins. status shows what is
attached and the counters: of these pins and of every running proxy whose worker 0
pinned its maps (`workers` > 1, /sys/fs/bpf/aiproxy/proxy-<supervisor pid>, found
through /proc/<pid>/root also when the proxy runs under `ip netns exec`).
"""

from __future__ import annotations

import argparse
import json
import sys

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bpf_command", metavar="ACTION", required=True)
    for name, text in (("status", "show what is attached where, and the counters"),
                       ("attach", "load, fill maps from the config, attach to its interfaces"),
                       ("detach", "detach from the config's interfaces and remove the pins")):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("-c", "--config", required=True, metavar="FILE", help="TOML config file")
        p.add_argument("--netns", metavar="NAME", help="network namespace (ip netns) to act in")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "status":
            p.add_argument("--pid", type=int, metavar="PID",
                           help="only the proxy with this supervisor pid (default: every "
                                "running proxy with pinned maps, in --netns if given)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aiproxy bpf", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    from aiproxy.config import ConfigError, load_config

    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return EXIT_USAGE
    kernel = cfg.kernel
    if cfg.policy is not None and kernel.interfaces:
        # [policy] deny rules on source CIDRs alone are dropped in XDP too.
        import dataclasses

        from aiproxy.governance.policy import kernel_deny_cidrs, load_policy_files

        extra = kernel_deny_cidrs(load_policy_files(cfg.policy.files))
        kernel = dataclasses.replace(kernel, deny_cidrs=tuple(dict.fromkeys(
            kernel.deny_cidrs + extra)))
    if not kernel.interfaces:
        print(f"{args.config}: [kernel] names no interfaces: nothing to do", file=sys.stderr)
        return EXIT_USAGE
    from . import attach
    from .libbpf import BPFError

    try:
        attach.check_netns(args.netns)  # before anything is loaded or pinned for it
        return {"status": _status, "attach": _attach, "detach": _detach}[args.bpf_command](
            kernel, args)
    except BPFError as exc:
        print(f"aiproxy bpf {args.bpf_command}: {exc}", file=sys.stderr)
        return EXIT_FAIL


def _emit(args, data: dict, lines: list[str]) -> None:
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        print("\n".join(lines))


def _counter_lines(indent: str, counters: dict) -> list[str]:
    lines = []
    for family, values in counters.items():
        if family == "xdp":
            lines.append(indent + "xdp_guard: " + " ".join(f"{k}={v}" for k, v in values.items()))
        elif family == "deny":
            lines.append(f"{indent}deny list: {values['v4']} IPv4, {values['v6']} IPv6 prefixes")
        else:
            for name, st in values.items():
                lines.append(f"{indent}tc class {name}: packets={st['packets']} "
                             f"bytes={st['bytes']}")
    return lines


def _status(kernel, args) -> int:
    from . import attach
    from .lifecycle import proxy_pin_dir, running_proxies
    from .manager import pin_dir_for, pinned_counters

    interfaces = {}
    lines = []
    for ifname in kernel.interfaces:
        try:
            st = attach.interface_state(ifname, args.netns)
        except attach.AttachError as exc:
            interfaces[ifname] = {"error": str(exc)}
            lines.append(f"{ifname}: {exc}")
            continue
        interfaces[ifname] = {"xdp": st.xdp_mode, "xdp_prog_id": st.xdp_prog_id,
                              "tc_ingress": st.tc_ingress, "tc_egress": st.tc_egress}
        xdp = f"xdp {st.xdp_mode} (prog id {st.xdp_prog_id})" if st.xdp_mode else "xdp -"
        tc = ",".join(d for d, on in (("ingress", st.tc_ingress), ("egress", st.tc_egress)) if on)
        lines.append(f"{ifname}: {xdp}; tc {tc or '-'}")
    counters = {} if args.pid else pinned_counters(pin_dir_for(args.netns), kernel)
    lines += _counter_lines("", counters)
    proxies = {}
    for pid, pin_dir in running_proxies(args.netns).items():
        if args.pid and pid != args.pid:
            continue
        proxies[str(pid)] = {"pin_dir": proxy_pin_dir(pid),
                             "counters": pinned_counters(pin_dir, kernel)}
        lines.append(f"proxy pid {pid} ({proxy_pin_dir(pid)}):")
        lines += _counter_lines("  ", proxies[str(pid)]["counters"])
    if args.pid and not proxies:
        print(f"aiproxy bpf status: no running proxy with pid {args.pid} has pinned maps",
              file=sys.stderr)
        return EXIT_FAIL
    _emit(args, {"netns": args.netns, "interfaces": interfaces, "counters": counters,
                 "proxies": proxies}, lines)
    return EXIT_FAIL if any("error" in st for st in interfaces.values()) else EXIT_OK


def _attach(kernel, args) -> int:
    from .manager import KernelFastPaths, pin_dir_for

    fast = KernelFastPaths(kernel, netns=args.netns, pin_dir=pin_dir_for(args.netns))
    attached = fast.start()
    counters = fast.counters()
    # Leave the programs attached and the maps pinned: that is the point of this command.
    for obj in (fast.guard_obj, fast.tc_obj):
        if obj is not None:
            obj.close()
    lines = [f"{ifname}: xdp {what.get('xdp', '-')}; tc {'ingress,egress' if what.get('tc') else '-'}"
             for ifname, what in attached.items()]
    _emit(args, {"netns": args.netns, "attached": attached, "counters": counters}, lines)
    return EXIT_OK


def _detach(kernel, args) -> int:
    from . import attach
    from .manager import pin_dir_for, remove_pins

    result = {}
    lines = []
    failed = False
    for ifname in kernel.interfaces:
        try:
            xdp = attach.detach_xdp(ifname, args.netns)
            tc = [d for d in attach.TC_PARENTS if attach.detach_tc(ifname, d, args.netns)]
        except attach.AttachError as exc:
            failed = True
            result[ifname] = {"error": str(exc)}
            lines.append(f"{ifname}: {exc}")
            continue
        result[ifname] = {"xdp": bool(xdp and xdp.ours), "tc": tc}
        if xdp is not None and not xdp.ours:
            # Not ours to remove; aiproxy is off the interface all the same (exit 0).
            result[ifname]["xdp_foreign"] = {"id": xdp.id, "name": xdp.name, "mode": xdp.mode}
            print(f"aiproxy bpf detach: {ifname}: XDP program {xdp} is not aiproxy's; "
                  "left attached", file=sys.stderr)
        xdp_text = ("detached" if xdp.ours else f"{xdp} left attached (not aiproxy's)"
                    ) if xdp is not None else "none"
        lines.append(f"{ifname}: xdp {xdp_text}; "
                     f"tc {','.join(tc) + ' detached' if tc else 'none'}")
    remove_pins(pin_dir_for(args.netns))
    _emit(args, {"netns": args.netns, "detached": result}, lines)
    return EXIT_FAIL if failed else EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
