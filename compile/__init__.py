"""compile package."""
