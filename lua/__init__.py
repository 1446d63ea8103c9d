"""The ledger's Lua scripts, one file per atomic operation (see each file's header).

A package only so that the scripts are package data: core/stores/scripts.py reads them with
importlib.resources, which finds them wherever this package is imported from, a checkout, an
editable install, an installed wheel or a deploy artifact, instead of guessing a path beside
the sources.
"""
