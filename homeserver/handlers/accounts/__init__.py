"""Accounts and auth: access tokens and requesters, registration, login, user-interactive auth, devices, profiles, account data, filters, deactivation."""
