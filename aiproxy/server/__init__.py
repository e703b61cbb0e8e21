import signal

# Each stops the proxy gracefully (listeners closed, requests drained). SIGQUIT is
# nginx's graceful stop (`nginx -s quit`); its default action would end the process at
# once, with a core dump, cutting every request in flight.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
