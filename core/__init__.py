"""spend-ceiling's domain: price -> reserve -> call -> settle against a shared ledger.

Framework-free: nothing here imports a web framework or an HTTP client.
"""

# The one place the version is written: pyproject.toml reads it (setuptools `attr:`), and a
# deployed bundle, which carries the source but no installed metadata, reads it here.
__version__ = "0.1.0"
