"""HTTP routes: parse, call a service, return JSON or SSE."""
