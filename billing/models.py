"""Usage-event outbox (see issue 4)."""
