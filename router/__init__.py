"""kvrouter's service: the FastAPI app (``/route`` placement API and OpenAI proxy), pure scoring,
load accounting, predicted blocks against herding, tokenization, worker registry and metrics.

Depends on ``indexer`` only; never imports ``engine``.
"""
