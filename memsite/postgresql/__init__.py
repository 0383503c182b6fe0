"""Django's PostgreSQL backend with a cheaper pool checkout check (see base.py)."""
