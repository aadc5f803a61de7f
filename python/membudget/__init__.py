"""membudget (being written)."""
