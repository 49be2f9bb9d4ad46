"""`dsv41 serve`: the model behind an OpenAI-compatible HTTP endpoint (docs/serve.md)."""

from __future__ import annotations

import os
from typing import Optional

import typer

from dsv41_cli.common import DeviceOpt, ModelOpt, load_on_ranks, resolve_model_dir, start_ranks
from dsv41_cli.console import fail, need_module

EPILOG = """Examples:

\b
  dsv41 serve
  dsv41 serve --port 8001 --max-batch-size 16 --api-key "$KEY"
  curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "dsv41-tiny", "messages": [{"role": "user", "content": "Add: 7 3 9 2 5"}]}'

SIGTERM or Ctrl-C stops admitting, lets the requests in flight finish (--grace seconds), then exits.
"""


def command(
    model: Optional[str] = ModelOpt,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (default: loopback only; "
                             "0.0.0.0 listens on every interface)."),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="TCP port (0: any free port, printed)."),
    device: str = DeviceOpt,
    max_batch_size: int = typer.Option(32, "--max-batch-size", min=1, help="Requests decoding at once "
                                       "(continuous batching)."),
    max_batch_tokens: Optional[int] = typer.Option(None, "--max-batch-tokens", min=1, show_default=False,
                                                   help="The requests in flight reserve their prompt and max_tokens; "
                                                   "at most this many positions in all (default: --max-batch-size x "
                                                   "the model's context)."),
    max_queue: int = typer.Option(64, "--max-queue", min=0, help="Requests waiting beyond the running batch; "
                                  "past them the answer is 429 with Retry-After."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="DSV41_API_KEY", show_default=False,
                                          help="Require `Authorization: Bearer KEY` (GET /health stays open)."),
    grace: float = typer.Option(30.0, "--grace", min=0.0, help="Seconds the requests in flight get to finish "
                                "after SIGTERM."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name", show_default=False,
                                                    help="The model id clients send (default: the checkpoint "
                                                    "directory's name, dsv41-tiny for the bundled model)."),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn's log level: debug|info|warning|error."),
):
    for module in ("uvicorn", "starlette"):
        need_module(module, "serve", "dsv41 serve")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        fail("dsv41 serve runs in one process; start it without torchrun")
    if log_level not in ("debug", "info", "warning", "error"):
        fail(f"--log-level must be debug, info, warning or error, not {log_level!r}")
    model_dir = resolve_model_dir(model)
    ctx = start_ranks(device)
    net, args, tokenizer = load_on_ranks(model_dir, ctx)

    from dsv41.model.engine import Generator
    from dsv41.serve.server import print_ready, serve

    try:
        serve(Generator(net, tokenizer, source=model_dir), tokenizer, served_model_name or model_dir.name,
              host=host, port=port, max_batch_size=max_batch_size, max_batch_tokens=max_batch_tokens,
              max_queue=max_queue, api_key=api_key, grace_seconds=grace, log_level=log_level, on_ready=print_ready)
    except OSError as e:
        fail(f"--host {host} --port {port}: {e}")
