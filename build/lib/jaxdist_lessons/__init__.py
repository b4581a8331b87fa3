"""jaxdist_lessons."""
