"""The bytes in and out: the client's side (`edge`, the bare ASGI entry of the PD routes and the answers it sends)
and the workers' side (`upstream`, the router's own HTTP/1.1 client, and `upstream_response`, what it hands back).
Knows nothing of pairs, policies or OpenAI: every other room builds on it."""
