"""Search algorithms: every one implements the Sharder protocol (search/base.py)."""
