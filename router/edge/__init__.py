"""The router's front doors and its HTTP edge: the app (``app``: ``create_app``), the hot-path
dispatch ahead of FastAPI (``dispatch``), the server config (``server``), the access log, tracing,
request bodies (``bodies``), ``/route`` (``route``), the OpenAI proxy (``proxy``), the admin and
ops endpoints (``admin``), the OpenAPI document. Nothing is imported here."""
