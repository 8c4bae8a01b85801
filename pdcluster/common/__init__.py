"""What every process of the cluster uses, whatever its role: the typed messages between workers, the bootstrap service
and the router (protocol.py), the HTTP edge of our servers and its JSON errors (http.py, http_server.py), config files
and their one-line errors (config_file.py), JSON-line logs (logs.py), the OpenTelemetry settings (otel.py) and child
processes that die with their parent (children.py). It imports no other room of pdcluster: every room may import it."""
