"""Session-scoped fixtures shared by the worker test modules (registered in conftest.py)."""
