"""The agent turn lifecycle (issue 13, seed 002): before_turn, after_turn, maintenance,
introspection, and seed 001's prefetch. Services in `services.py`, reads in `selectors.py`."""
