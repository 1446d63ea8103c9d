"""Vercel's entry point: the Python runtime serves the ASGI `app` of this module."""

from api.app import create_app

app = create_app()
