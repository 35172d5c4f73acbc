"""kvrouter's event plane: wire decoding of vLLM/SGLang KV events, the global prefix index, and
the asyncio ZMQ subscriber that is its only writer. No HTTP and no torch live here."""
