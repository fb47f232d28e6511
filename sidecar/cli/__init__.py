"""Command-line entry points: `kvgate plan`, `kvgate serve`, and small helpers."""
