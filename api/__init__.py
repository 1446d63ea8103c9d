"""The HTTP service: FastAPI handlers over core. Parse -> call core -> serialize."""
