"""Build hook for the optional C accelerator of the router block hash.

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
        )
    ]
)
