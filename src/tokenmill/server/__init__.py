"""The HTTP server: OpenAI-compatible routes (completions, chat, responses, models, tokenize),
Anthropic's Messages API, TGI routes, Prometheus metrics and API-key auth over an AsyncLLMEngine.

    args.py                ServerArgs: every server flag, defined once (serve(), build_app(), the Ray ingress)
    app.py                 build_app(), middleware (auth, access log), DrainingServer, serve(), BackgroundServer
    protocol.py            pydantic request / response models (OpenAI and vLLM fields)
    context.py             ServerContext: the engine, the ServerArgs, metrics, tracer (get_ctx)
    checks.py              input checks in vLLM's words: model / adapter, sampling fields, context length
    sampling.py            a request's sampling fields -> SamplingParams (every route), structured output
    engine_streams.py      request ids and trackers, engine streams started / collected / merged, beam search
    sse.py                 disconnects, SSE responses and framing, errors inside a stream
    logprobs.py            logprobs as the APIs write them
    openai_completions.py  POST /v1/completions
    openai_chat.py         POST /v1/chat/completions
    openai_responses.py    POST /v1/responses, GET / DELETE /v1/responses/{id} (OpenAI's Responses API)
    anthropic_messages.py  POST /v1/messages, POST /v1/messages/count_tokens (Anthropic's Messages API)
    conversation.py        what chat, Messages and Responses share: render, sample, start, answers (streamed)
    anthropic_protocol.py, responses_protocol.py   their pydantic models
    misc_routes.py         /v1/models, /tokenize, /detokenize, /health, /version, /metrics
    tgi_routes.py          POST /generate, POST /generate_stream, GET /info
    metrics.py             tokenmill:* Prometheus metrics
    errors.py              error bodies (OpenAI's; TGI's and Anthropic's on theirs) and exception handlers
    chat_template.py       chat-template rendering for the routes, bounded (size, time, trust)
    listen.py              the listening socket bound before the model loads; the route listing
    web_ui.py              the web playground and live dashboard at / (static files in web/)
"""

__all__ = ["build_app", "serve", "BackgroundServer", "ServerArgs"]


def __getattr__(name: str):
    if name in __all__:
        # lazy: `tokenmill.server.args` and the startup path stay free of FastAPI's imports
        from tokenmill.server import app

        return getattr(app, name)
    raise AttributeError(name)
