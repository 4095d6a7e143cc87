"""Sync: /sync (incremental, initial, long-poll), the legacy /events and /initialSync, and simplified sliding sync."""
