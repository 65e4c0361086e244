"""`kvtier serve`'s OpenAI-compatible HTTP server over an `Engine`: the app and its routes, the
requests' protocol and parameters, the worker thread that steps the engine, the metrics and the
HTTP edge.

- `app`: `create_app(engine, name, ...)`, the FastAPI app (its lifetime owns the engine);
- `routes`: admission (body size, queue, body deadline), parsing, queueing, answers and streams;
- `protocol`, `params`, `choices`: OpenAI's request and reply shapes, a request's fields as
  `SamplingParams`, a request's choices gathered from the worker;
- `worker`: the thread that owns the engine; `metrics`: `/metrics`; `web`: errors in OpenAI's
  shape, the API key, the listening socket; `limits`: the admission limits (plain values).

The server sits on `kvtier.engine`; nothing in `kvtier.engine` imports it. The command
(`kvtier serve`: flags, model loading, signals) is `kvtier.cli.serve`.
"""
