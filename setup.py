"""Build hook for the optional C accelerators: the router block hash and index tables
(``indexer._chash``) and the router's body scanner and load counts (``router._native``). The
scorer has no C twin any more: it saved 10-20 µs a placement at the price of a second copy of
the cost formula (docs/replay.md measures /route without it).

The extension is `optional`: if no compiler is present the install still succeeds and
`indexer.hashing` falls back to the pure-Python implementation, which gives identical values.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "indexer._chash",
            sources=["indexer/_chash.c"],
            optional=True,
            extra_compile_args=["-O3"],
        ),
        # the router's /route body scanner and load reference counts (see the file's header)
        Extension(
            "router._native",
            sources=["router/_native.c"],
            optional=True,
            extra_compile_args=["-O3"],
        ),
    ]
)
