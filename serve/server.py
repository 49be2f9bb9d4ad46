"""Running the endpoint: the engine thread, the application, uvicorn, and a graceful SIGTERM.

SIGTERM (or Ctrl-C): the server stops admitting at once (new requests get 503, and uvicorn closes the
listening socket), lets the requests in flight finish for up to `grace_seconds`, cancels what is left,
stops the engine thread and exits 0 (after Ctrl-C: 130, as every command's interrupt). A second Ctrl-C
exits at once.
"""

from __future__ import annotations

import logging
import signal
import sys


def serve(generator, tokenizer, model_name: str, *, host: str = "127.0.0.1", port: int = 8000,
          max_batch_size: int = 32, max_batch_tokens: int | None = None, max_queue: int = 64,
          api_key: str | None = None, grace_seconds: float = 30.0, log_level: str = "info",
          on_ready=None) -> None:
    """Serve `generator` (a model.engine.Generator with its tokenizer) until SIGTERM/SIGINT.
    on_ready(host, port) is called once the socket listens (the port is the real one for port 0)."""
    import uvicorn

    from dsv41.serve.app import build_app
    from dsv41.serve.worker import Worker

    worker = Worker(generator, max_batch_size, max_batch_tokens)
    worker.start()
    app = build_app(worker, tokenizer, model_name, api_key=api_key, max_queue=max_queue, on_shutdown=worker.stop)
    state = app.state.serve

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            state.draining = True  # from this moment every new request is a 503
            super().handle_exit(sig, frame)
            # uvicorn raises a captured signal again after its shutdown; SIGTERM asked for exactly that
            # graceful shutdown, so the process exits 0 (Ctrl-C still ends as an interrupt, exit 130)
            if sig == signal.SIGTERM:
                self._captured_signals.remove(sig)

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if on_ready is not None and self.servers:
                bound = self.servers[0].sockets[0].getsockname()
                on_ready(bound[0], bound[1])

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=grace_seconds,
                            lifespan="on", access_log=log_level == "debug")
    server = _Server(config)
    logging.getLogger("dsv41.serve").setLevel(log_level.upper())
    try:
        server.run()
    finally:
        worker.stop()
    if not server.started:
        raise OSError(f"could not listen on {host}:{port} (in use, or not an address of this machine)")


def print_ready(host: str, port: int) -> None:
    """The line scripts wait for (tests and the load benchmark read the port from it)."""
    print(f"dsv41 serve: listening on http://{host}:{port}/v1", file=sys.stderr, flush=True)
