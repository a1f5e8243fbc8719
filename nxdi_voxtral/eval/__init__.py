"""Offline evaluation tools."""
