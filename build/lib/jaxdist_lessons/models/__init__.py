"""Models used across the book."""
