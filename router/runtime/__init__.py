"""The runtime glue around the placement core: :class:`Runtime` (the index and its subscriber,
the upstream pool, the worker table and health checks, metrics, the tokenizer, the Placer) and the
tokenizers (:mod:`router.runtime.tokenize`). Built by ``create_app``'s lifespan."""

from router.runtime.service import Runtime, load_index

__all__ = ["Runtime", "load_index"]
