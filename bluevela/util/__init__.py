"""Small shared helpers with no heavy imports."""
