"""Ephemeral facts: presence, typing notices, read receipts, and the EDUs they send to other servers."""
