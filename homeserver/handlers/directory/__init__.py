"""Directories and search: the public room directory, space hierarchies, message search, the user directory."""
