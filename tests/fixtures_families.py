"""Session-scoped fixtures shared by the families test modules (registered in conftest.py)."""
