"""The aiohttp sidecar: proxy, admission wiring, health and admin routes."""
