"""`dsv41 serve`: the model behind an OpenAI-compatible HTTP endpoint (docs/serve.md).

    protocol.py   request bodies -> validated parameters (OpenAI schema, DeepSeek's effort mapping), errors
    stream.py     the reply builders: CompletionStream events -> chat deltas (stop strings, usage); raw text
    scoring.py    per-token log-probabilities of a prompt (/v1/completions echo + logprobs)
    worker.py     the engine thread: it alone owns the model and steps the Scheduler; handlers talk to it
                  through a queue, and it answers each request on its own asyncio queue
    app.py        the Starlette application: routes, bearer check, bounded admission (429), SSE
    server.py     loading the model and running uvicorn with a graceful SIGTERM

Starlette and uvicorn are the optional extra `.[serve]`; only app.py and server.py import them.
"""
