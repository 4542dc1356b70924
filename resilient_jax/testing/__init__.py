"""Test doubles for tests and experiments; nothing in the library imports this package."""
