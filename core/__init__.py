"""spend-ceiling's domain: price -> reserve -> call -> settle against a shared ledger.

Framework-free: nothing here imports a web framework or an HTTP client.
"""
