"""Data: prompt sources and the label schema."""
