import signal

# Each stops the proxy gracefully (listeners closed, requests drained). SIGQUIT is
# nginx's graceful stop (`nginx -s quit`); its default action would end the process at
# once, with a core dump, cutting every request in flight.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
# Sent again while the proxy drains, each ends the drain at once (nginx's SIGTERM/SIGINT
# are a fast stop); a worker takes this from its supervisor, not from a signal, as it
# also gets the group's SIGINT or systemd's SIGTERM beside the supervisor's own.
HURRY_SIGNALS = (signal.SIGTERM, signal.SIGINT)
