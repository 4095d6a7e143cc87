"""End-to-end encryption: device and one-time keys, cross-signing, key backups."""
