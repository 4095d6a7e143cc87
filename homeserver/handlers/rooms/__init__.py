"""Rooms and events: creating, sending and persisting events, loading them, membership, history (/messages, /context), relations, upgrades, partial-state rooms."""
