"""Session-scoped fixtures shared by the runner test modules (registered in conftest.py)."""
